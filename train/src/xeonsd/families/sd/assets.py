"""SD 1.x/2.x's offline pipelines (``make-tiny-model --arch``): ``tiny`` (64 px, trains in seconds), ``tiny-v``
(the SD 2.x style: v-prediction, linear projections, per-level head dims, GELU text encoder), and the real widths
for benchmarks: ``sd15`` (UNet ~860M parameters, CLIP-L) and ``sd21`` (768-v, an OpenCLIP-H-sized encoder)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from xeonsd.assets.models import Arch, make_unet_model
from xeonsd.assets.parts import CLIP_L, TINY_CLIP, Clip

ARCHS: dict[str, Arch] = {
    "tiny": Arch(
        unet_channels=(32, 64),
        unet_layers=1,
        unet_heads=2,
        unet_down=("CrossAttnDownBlock2D", "DownBlock2D"),
        unet_up=("UpBlock2D", "CrossAttnUpBlock2D"),
        sample_size=8,
        vae_channels=(8, 8, 16, 16),
        vae_layers=1,
        text=TINY_CLIP,
        vocab_size=None,
        norm_groups=8,
    ),
    "sd15": Arch(
        unet_channels=(320, 640, 1280, 1280),
        unet_layers=2,
        unet_heads=8,
        unet_down=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        unet_up=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        sample_size=64,
        vae_channels=(128, 256, 512, 512),
        vae_layers=2,
        text=CLIP_L,
        vocab_size=49408,
        norm_groups=32,
    ),
}
ARCHS["sd21"] = dataclasses.replace(
    ARCHS["sd15"],
    unet_heads=(5, 10, 20, 20),
    sample_size=96,
    text=Clip(hidden=1024, layers=23, heads=16, intermediate=4096, act="gelu"),
    prediction_type="v_prediction",
    linear_projection=True,
)
ARCHS["tiny-v"] = dataclasses.replace(
    ARCHS["tiny"],
    unet_heads=(2, 4),
    prediction_type="v_prediction",
    linear_projection=True,
    text=dataclasses.replace(TINY_CLIP, act="gelu"),
)


def make(out: Path, arch: str, a: Arch, seed: int = 0, depth: int | None = None, configs_only: bool = False) -> Path:
    """A random-weight ``StableDiffusionPipeline`` of ``a``."""
    return make_unet_model(out, arch, a, seed=seed)
