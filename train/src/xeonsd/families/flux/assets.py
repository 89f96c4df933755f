"""FLUX.1's offline pipelines (``make-tiny-model --arch``): ``flux`` (FLUX.1-dev's widths in bf16, ``--depth``
cuts its blocks) for benchmarks, ``tiny-flux`` (the same structure at 64 px) for the tests; the CLIP and T5 side and
the VAE are :mod:`xeonsd.assets.flow_models`'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from xeonsd.assets.flow_models import FLUX_SHIFT, T5, T5_XXL, FlowArch, make_flow_model
from xeonsd.assets.parts import CLIP_L, TINY_CLIP

ARCHS: dict[str, FlowArch] = {
    # FLUX.1-dev: 19 double + 38 single blocks, 24 heads x 128 (3072 wide, 11.9 B parameters), guidance embedding.
    "flux": FlowArch(
        layers=19,
        single_layers=38,
        heads=24,
        head_dim=128,
        guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
        clip_l=CLIP_L,
        t5=T5_XXL,
        vae_channels=(128, 256, 512, 512),
        vae_layers=2,
        vae_scaling=0.3611,
        vae_shift=0.1159,
        norm_groups=32,
        sample_size=128,
        clip_vocab_size=49408,
        weights_dtype="bfloat16",
        cuts_depth=True,
    ),
    # The same structure at the tiny pipelines' size (64 px), for the tests.
    "tiny-flux": FlowArch(
        layers=1,
        single_layers=1,
        heads=2,
        head_dim=16,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
        clip_l=TINY_CLIP,
        t5=T5(d_model=32, layers=2, heads=4, d_kv=8, d_ff=64, max_length=32),
        vae_channels=(8, 8, 16, 16),
        vae_layers=1,
        vae_scaling=0.3611,
        vae_shift=0.1159,
        norm_groups=8,
        sample_size=8,
    ),
}


def transformer(a: FlowArch) -> Any:
    from diffusers import FluxTransformer2DModel

    assert sum(a.axes_dims_rope) == a.head_dim, "FLUX's rotary axes split the head dimension"
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * 16,  # 16 latent channels packed 2x2
        num_layers=a.layers,
        num_single_layers=a.single_layers,
        attention_head_dim=a.head_dim,
        num_attention_heads=a.heads,
        joint_attention_dim=a.t5.d_model,
        pooled_projection_dim=a.clip_l.hidden,
        guidance_embeds=a.guidance_embeds,
        axes_dims_rope=a.axes_dims_rope,
    )


def scheduler(a: FlowArch) -> Any:
    """FLUX.1's: the shift grows with the image's token count."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**FLUX_SHIFT)


def pipeline(*, clip_l: Any, clip_g: Any, t5: Any, t5_tokenizer: Any, **parts: Any) -> Any:
    from diffusers import FluxPipeline

    return FluxPipeline(**parts, text_encoder=clip_l, text_encoder_2=t5, tokenizer_2=t5_tokenizer)


def make(
    out: Path, arch: str, a: FlowArch, seed: int = 0, depth: int | None = None, configs_only: bool = False
) -> Path:
    """A random-weight ``FluxPipeline`` of ``a``."""
    return make_flow_model(out, arch, a, transformer, scheduler, pipeline, seed=seed, depth=depth)
