"""SDXL's offline pipelines (``make-tiny-model --arch``): ``sdxl`` (the base 1.0 architecture: UNet 2.57 B
parameters, CLIP-L and OpenCLIP-bigG, 1024 px) for benchmarks, and ``tiny-xl`` (its structure at 64 px) for the
tests."""

from __future__ import annotations

from pathlib import Path

from xeonsd.assets.models import Arch, make_unet_model
from xeonsd.assets.parts import CLIP_G, CLIP_L, TINY_CLIP, TINY_CLIP_G

ARCHS: dict[str, Arch] = {}
# SDXL base 1.0: UNet 2.57 B parameters (no attention at the first level, 1/2/10 transformer layers below),
# CLIP-L and OpenCLIP-bigG text encoders (123 M + 695 M), 1024 px, its VAE's scaling factor.
ARCHS["sdxl"] = Arch(
    unet_channels=(320, 640, 1280),
    unet_layers=2,
    unet_heads=(5, 10, 20),
    unet_down=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    unet_up=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    sample_size=128,
    vae_channels=(128, 256, 512, 512),
    vae_layers=2,
    text=CLIP_L,
    vocab_size=49408,
    norm_groups=32,
    linear_projection=True,
    text2=CLIP_G,
    transformer_layers=(1, 2, 10),
    time_embed_dim=256,
    vae_scaling=0.13025,
)
# The same structure at the tiny pipeline's size (64 px), for the tests.
ARCHS["tiny-xl"] = Arch(
    unet_channels=(32, 64),
    unet_layers=1,
    unet_heads=(2, 4),
    unet_down=("DownBlock2D", "CrossAttnDownBlock2D"),
    unet_up=("CrossAttnUpBlock2D", "UpBlock2D"),
    sample_size=8,
    vae_channels=(8, 8, 16, 16),
    vae_layers=1,
    text=TINY_CLIP,
    vocab_size=None,
    norm_groups=8,
    linear_projection=True,
    text2=TINY_CLIP_G,
    transformer_layers=(1, 2),
    time_embed_dim=8,
    vae_scaling=0.13025,
)


def make(out: Path, arch: str, a: Arch, seed: int = 0, depth: int | None = None, configs_only: bool = False) -> Path:
    """A random-weight ``StableDiffusionXLPipeline`` of ``a``."""
    return make_unet_model(out, arch, a, seed=seed)
