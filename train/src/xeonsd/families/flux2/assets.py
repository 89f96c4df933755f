"""FLUX.2 [klein]'s offline pipelines (``make-tiny-model --arch``): ``flux2-klein`` (klein-4B's widths in bf16,
``--depth`` cuts its blocks) for benchmarks, ``tiny-flux2`` (the same structure at 64 px) for the tests; the Qwen
text side is :mod:`xeonsd.assets.open_text`'s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from xeonsd.assets.flow_models import FLUX_SHIFT
from xeonsd.assets.open_models import QWEN3_4B, OpenArch, OpenParts, make_open_model
from xeonsd.assets.open_text import QwenText, qwen3_encoder

CONFIGS_ONLY = True  # make-tiny-model --configs-only: the configs without weights
ARCHS: dict[str, OpenArch] = {
    # FLUX.2-klein-4B: 5 double + 20 single blocks, 24 heads x 128, context = 3 x Qwen3-4B's 2560 (diffusers'
    # scripts/convert_flux2_to_diffusers.py, "klein-4b").
    "flux2-klein": OpenArch(
        layers=5,
        single_layers=20,
        heads=24,
        head_dim=128,
        axes_dims_rope=(32, 32, 32, 32),
        text=QWEN3_4B,
        vae_channels=(128, 256, 512, 512),
        vae_layers=2,
        weights_dtype="bfloat16",
        cuts_depth=True,
    ),
    # The same structure at the tiny pipelines' size (64 px), for the tests.
    "tiny-flux2": OpenArch(
        layers=1,
        single_layers=2,
        heads=2,
        head_dim=16,
        axes_dims_rope=(4, 4, 4, 4),
        text=QwenText(hidden=32, layers=28, heads=2, kv_heads=1, intermediate=64, head_dim=16, tie_embeddings=True),
        vae_channels=(8, 8, 16, 16),
        vae_layers=1,
        norm_groups=8,
        sample_px=64,
    ),
}


def transformer(a: OpenArch, guidance_embeds: bool = False) -> Any:
    """FLUX.2's transformer of ``a`` (``guidance_embeds``: FLUX.2 [dev]'s, guidance-distilled)."""
    from diffusers import Flux2Transformer2DModel

    assert sum(a.axes_dims_rope) == a.head_dim, "FLUX.2's rotary axes split the head dimension"
    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * 32,  # 32 latent channels patchified 2x2
        num_layers=a.layers,
        num_single_layers=a.single_layers,
        attention_head_dim=a.head_dim,
        num_attention_heads=a.heads,
        joint_attention_dim=3 * a.text.hidden,  # three stacked encoder layers
        timestep_guidance_channels=256,
        mlp_ratio=3.0,
        axes_dims_rope=a.axes_dims_rope,
        rope_theta=2000,
        eps=1e-6,
        guidance_embeds=guidance_embeds,
    )


def vae(a: OpenArch) -> Any:
    from diffusers import AutoencoderKLFlux2

    n = len(a.vae_channels)
    return AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=a.vae_channels,
        layers_per_block=a.vae_layers,
        latent_channels=32,
        norm_num_groups=a.norm_groups,
        sample_size=a.sample_px,
        use_quant_conv=True,
        use_post_quant_conv=True,
        batch_norm_eps=1e-4,
        patch_size=(2, 2),
    )


def scheduler(a: OpenArch) -> Any:
    """The released model's: the shift follows the resolution (the pipeline passes ``mu``)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**FLUX_SHIFT, time_shift_type="exponential")


def pipeline(**parts: Any) -> Any:
    """klein-4B is step-distilled: no classifier-free guidance."""
    from diffusers import Flux2KleinPipeline

    return Flux2KleinPipeline(is_distilled=True, **parts)


PARTS = OpenParts(transformer, vae, scheduler, qwen3_encoder, pipeline)


def make(
    out: Path, arch: str, a: OpenArch, seed: int = 0, depth: int | None = None, configs_only: bool = False
) -> Path:
    """A random-weight ``Flux2KleinPipeline`` of ``a``."""
    return make_open_model(out, arch, a, PARTS, seed=seed, depth=depth, configs_only=configs_only)
