"""Z-Image's offline pipelines (``make-tiny-model --arch``): ``zimage`` (Z-Image-Turbo's widths in bf16,
``--depth`` cuts its main layers) for benchmarks, ``tiny-zimage`` (the same structure at 64 px) for the tests; the
Qwen text side is :mod:`xeonsd.assets.open_text`'s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from xeonsd.assets.open_models import QWEN3_4B, OpenArch, OpenParts, make_open_model
from xeonsd.assets.open_text import QwenText, qwen3_encoder
from xeonsd.assets.parts import vae_of

CONFIGS_ONLY = True  # make-tiny-model --configs-only: the configs without weights
ARCHS: dict[str, OpenArch] = {
    # Z-Image-Turbo: 30 layers (+ 2 noise and 2 caption refiners) 3840 wide, 30 heads x 128, Qwen3-4B.
    "zimage": OpenArch(
        layers=30,
        refiner_layers=2,
        heads=30,
        head_dim=128,
        axes_dims_rope=(32, 48, 48),
        axes_lens=(1536, 512, 512),
        text=QWEN3_4B,
        vae_channels=(128, 256, 512, 512),
        vae_layers=2,
        weights_dtype="bfloat16",
        cuts_depth=True,
    ),
    # The same structure at the tiny pipelines' size (64 px), for the tests.
    "tiny-zimage": OpenArch(
        layers=2,
        refiner_layers=2,
        heads=2,
        head_dim=16,
        axes_dims_rope=(4, 6, 6),
        axes_lens=(1536, 512, 512),
        text=QwenText(hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64, head_dim=16, tie_embeddings=True),
        vae_channels=(8, 8, 16, 16),
        vae_layers=1,
        norm_groups=8,
        sample_px=64,
    ),
}


def transformer(a: OpenArch) -> Any:
    from diffusers import ZImageTransformer2DModel

    assert sum(a.axes_dims_rope) == a.head_dim, "Z-Image's rotary axes split the head dimension"
    return ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=a.heads * a.head_dim,
        n_layers=a.layers,
        n_refiner_layers=a.refiner_layers,
        n_heads=a.heads,
        n_kv_heads=a.heads,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=a.text.hidden,
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=list(a.axes_dims_rope),
        axes_lens=list(a.axes_lens),
    )


def vae(a: OpenArch) -> Any:
    # FLUX.1's autoencoder: 16 channels, scaling and shift factors, no quant convs.
    return vae_of(a.vae_channels, a.vae_layers, a.norm_groups, a.sample_px, 0.3611, shift=0.1159)


def scheduler(a: OpenArch) -> Any:
    """Z-Image-Turbo's: a fixed shift of 3."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)


def pipeline(text_encoder: Any, **parts: Any) -> Any:
    """Z-Image ships the bare Qwen3Model (what its pipeline and training script load)."""
    from diffusers import ZImagePipeline

    return ZImagePipeline(text_encoder=text_encoder.model, **parts)


PARTS = OpenParts(transformer, vae, scheduler, qwen3_encoder, pipeline)


def make(
    out: Path, arch: str, a: OpenArch, seed: int = 0, depth: int | None = None, configs_only: bool = False
) -> Path:
    """A random-weight ``ZImagePipeline`` of ``a``."""
    return make_open_model(out, arch, a, PARTS, seed=seed, depth=depth, configs_only=configs_only)
