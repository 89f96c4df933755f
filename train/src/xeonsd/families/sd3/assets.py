"""SD3/SD3.5's offline pipelines (``make-tiny-model --arch``): ``sd35m`` (SD3.5 medium's widths in bf16) for
benchmarks, ``tiny-sd3`` (the same structure at 64 px) for the tests; the CLIP and T5 side and the VAE are
:mod:`xeonsd.assets.flow_models`'."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from xeonsd.assets.flow_models import T5, T5_XXL, FlowArch, make_flow_model
from xeonsd.assets.parts import CLIP_G, CLIP_L, TINY_CLIP, TINY_CLIP_G

ARCHS: dict[str, FlowArch] = {
    # SD3.5 medium: 24 MMDiT blocks, 24 heads x 64, dual attention in the first 13, RMS q/k norm; CLIP-L, CLIP-G, T5-XXL.
    "sd35m": FlowArch(
        layers=24,
        heads=24,
        head_dim=64,
        clip_l=CLIP_L,
        clip_g=CLIP_G,
        t5=dataclasses.replace(T5_XXL, max_length=256),
        dual_attention_layers=tuple(range(13)),
        qk_norm="rms_norm",
        pos_embed_max_size=384,
        vae_channels=(128, 256, 512, 512),
        vae_layers=2,
        vae_scaling=1.5305,
        vae_shift=0.0609,
        norm_groups=32,
        sample_size=128,
        clip_vocab_size=49408,
        weights_dtype="bfloat16",
    ),
    # The same structure at the tiny pipelines' size (64 px), for the tests.
    "tiny-sd3": FlowArch(
        layers=2,
        heads=2,
        head_dim=16,
        clip_l=TINY_CLIP,
        clip_g=TINY_CLIP_G,
        t5=T5(d_model=64, layers=2, heads=4, d_kv=16, d_ff=128, max_length=32),
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
        pos_embed_max_size=16,
        vae_channels=(8, 8, 16, 16),
        vae_layers=1,
        vae_scaling=1.5305,
        vae_shift=0.0609,
        norm_groups=8,
        sample_size=8,
    ),
}


def transformer(a: FlowArch) -> Any:
    from diffusers import SD3Transformer2DModel

    assert a.clip_g is not None
    clip_width = a.clip_l.hidden + a.clip_g.hidden
    if a.t5.d_model < clip_width:
        raise ValueError("SD3's CLIP hidden states are padded to T5's width: T5 must be the wider")
    return SD3Transformer2DModel(
        sample_size=a.sample_size,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=a.layers,
        attention_head_dim=a.head_dim,
        num_attention_heads=a.heads,
        joint_attention_dim=a.t5.d_model,
        caption_projection_dim=a.heads * a.head_dim,
        pooled_projection_dim=clip_width,
        pos_embed_max_size=a.pos_embed_max_size,
        dual_attention_layers=a.dual_attention_layers,
        qk_norm=a.qk_norm,
    )


def scheduler(a: FlowArch) -> Any:
    """SD3's: a fixed shift of 3."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=3.0)


def pipeline(*, clip_l: Any, clip_g: Any, t5: Any, t5_tokenizer: Any, tokenizer: Any, **parts: Any) -> Any:
    from diffusers import StableDiffusion3Pipeline

    return StableDiffusion3Pipeline(
        **parts,
        text_encoder=clip_l,
        tokenizer=tokenizer,
        text_encoder_2=clip_g,
        tokenizer_2=tokenizer,
        text_encoder_3=t5,
        tokenizer_3=t5_tokenizer,
    )


def make(
    out: Path, arch: str, a: FlowArch, seed: int = 0, depth: int | None = None, configs_only: bool = False
) -> Path:
    """A random-weight ``StableDiffusion3Pipeline`` of ``a``."""
    return make_flow_model(out, arch, a, transformer, scheduler, pipeline, seed=seed, depth=depth)
