"""Qwen-Image's offline pipelines (``make-tiny-model --arch``): ``qwenimage`` (its widths in bf16, ``--depth``
cuts its 60 blocks) for benchmarks, ``tiny-qwenimage`` (the same structure at 64 px, a vision tower included) for
the tests; the Qwen2.5-VL text side is :mod:`xeonsd.assets.open_text`'s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from xeonsd.assets.open_models import QWEN25_VL_7B, TINY_VISION, OpenArch, OpenParts, make_open_model
from xeonsd.assets.open_text import QwenText, qwen25vl_encoder

# Qwen-Image's VAE statistics (the released config's latents_mean / latents_std, also diffusers' defaults).
QWEN_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508)
QWEN_LATENTS_MEAN += (0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
QWEN_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743)
QWEN_LATENTS_STD += (3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)

CONFIGS_ONLY = True  # make-tiny-model --configs-only: the configs without weights
ARCHS: dict[str, OpenArch] = {
    # Qwen-Image: 60 MMDiT blocks, 24 heads x 128, Qwen2.5-VL-7B; VAE base_dim 96 x (1, 2, 4, 4).
    "qwenimage": OpenArch(
        layers=60,
        heads=24,
        head_dim=128,
        axes_dims_rope=(16, 56, 56),
        text=QWEN25_VL_7B,
        vae_channels=(96, 192, 384, 384),
        vae_layers=2,
        weights_dtype="bfloat16",
        cuts_depth=True,
    ),
    # The same structure at the tiny pipelines' size (64 px), for the tests.
    "tiny-qwenimage": OpenArch(
        layers=2,
        heads=2,
        head_dim=16,
        axes_dims_rope=(4, 6, 6),
        text=QwenText(
            hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64, mrope_section=(2, 3, 3), vision=TINY_VISION
        ),
        vae_channels=(8, 16, 32, 32),
        vae_layers=1,
        sample_px=64,
    ),
}


def transformer(a: OpenArch, **extra: Any) -> Any:
    """Qwen-Image's transformer of ``a`` (``extra``: more of its config, Qwen-Image-Edit-2511's ``zero_cond_t``)."""
    from diffusers import QwenImageTransformer2DModel

    assert sum(a.axes_dims_rope) == a.head_dim, "Qwen-Image's rotary axes split the head dimension"
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * 16,  # 16 latent channels packed 2x2
        out_channels=16,
        num_layers=a.layers,
        attention_head_dim=a.head_dim,
        num_attention_heads=a.heads,
        joint_attention_dim=a.text.hidden,
        guidance_embeds=False,
        axes_dims_rope=a.axes_dims_rope,
        **extra,
    )


def vae(a: OpenArch) -> Any:
    from diffusers import AutoencoderKLQwenImage

    base = a.vae_channels[0]
    return AutoencoderKLQwenImage(
        base_dim=base,
        z_dim=16,
        dim_mult=[c // base for c in a.vae_channels],
        num_res_blocks=a.vae_layers,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        latents_mean=list(QWEN_LATENTS_MEAN),
        latents_std=list(QWEN_LATENTS_STD),
    )


def scheduler(a: OpenArch) -> Any:
    """The released model's: the shift follows the resolution (the pipeline passes ``mu``)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )


def pipeline(**parts: Any) -> Any:
    from diffusers import QwenImagePipeline

    return QwenImagePipeline(**parts)


PARTS = OpenParts(transformer, vae, scheduler, qwen25vl_encoder, pipeline)


def make(
    out: Path, arch: str, a: OpenArch, seed: int = 0, depth: int | None = None, configs_only: bool = False
) -> Path:
    """A random-weight ``QwenImagePipeline`` of ``a``."""
    return make_open_model(out, arch, a, PARTS, seed=seed, depth=depth, configs_only=configs_only)
