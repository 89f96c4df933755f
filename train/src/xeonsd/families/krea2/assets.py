"""Krea 2's offline pipelines (``make-tiny-model --arch``): ``krea2`` (its widths in bf16, ``--depth`` cuts its 28
blocks; ``--configs-only`` for the estimate) for benchmarks, ``tiny-krea2`` (the same structure at 64 px, a Qwen3-VL
vision tower included) for the tests. Qwen-Image's VAE (:mod:`xeonsd.families.qwenimage.assets`), the Qwen3-VL text
side of :mod:`xeonsd.assets.open_text`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xeonsd.assets.open_models import OpenArch, OpenParts, make_open_model
from xeonsd.assets.open_text import Qwen3VLVision, QwenText, qwen3vl_encoder
from xeonsd.families.qwenimage import assets as qwenimage


@dataclass(frozen=True)
class Krea2Arch(OpenArch):
    """An :class:`OpenArch` with Krea 2's own widths: grouped-query heads, the SwiGLU width, the text fusion's
    blocks and the Qwen3-VL layers it taps (``select_layers``, the pipeline's ``text_encoder_select_layers``)."""

    kv_heads: int = 12
    intermediate: int = 16384
    timestep_dim: int = 256
    select_layers: tuple[int, ...] = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)
    text_heads: int = 20
    text_intermediate: int = 6912
    distilled: bool = False  # Krea 2 Turbo's is_distilled


# Qwen3-VL-4B-Instruct: 36 layers 2560 wide, 32 heads x 128 (8 key/value), a 24-layer vision tower.
QWEN3_VL_4B = QwenText(
    hidden=2560,
    layers=36,
    heads=32,
    kv_heads=8,
    intermediate=9728,
    head_dim=128,
    vocab_size=151936,
    rope_theta=5_000_000.0,
    max_positions=262144,
    mrope_section=(24, 20, 20),
    vision=Qwen3VLVision(depth=24, hidden=1024, intermediate=4096, heads=16, deepstack=(5, 11, 17)),
    tie_embeddings=True,
)

CONFIGS_ONLY = True  # make-tiny-model --configs-only: the configs without weights
ARCHS: dict[str, Krea2Arch] = {
    # Krea 2 RAW: 28 blocks, 48 heads x 128 (12 key/value), SwiGLU 16384; Qwen3-VL-4B; Qwen-Image's VAE.
    "krea2": Krea2Arch(
        layers=28,
        heads=48,
        head_dim=128,
        axes_dims_rope=(32, 48, 48),
        text=QWEN3_VL_4B,
        vae_channels=(96, 192, 384, 384),
        vae_layers=2,
        weights_dtype="bfloat16",
        cuts_depth=True,
    ),
    # The same structure at the tiny pipelines' size (64 px), for the tests: two Qwen3-VL layers, both tapped.
    "tiny-krea2": Krea2Arch(
        layers=2,
        heads=2,
        head_dim=16,
        axes_dims_rope=(4, 6, 6),
        text=QwenText(
            hidden=32,
            layers=2,
            heads=2,
            kv_heads=1,
            intermediate=64,
            head_dim=16,
            mrope_section=(2, 3, 3),
            vision=Qwen3VLVision(depth=1, hidden=16, intermediate=32, heads=2, deepstack=(0,), position_embeddings=16),
            tie_embeddings=True,
        ),
        vae_channels=(8, 16, 32, 32),
        vae_layers=1,
        sample_px=64,
        kv_heads=1,
        intermediate=64,
        timestep_dim=32,
        select_layers=(1, 2),
        text_heads=2,
        text_intermediate=64,
    ),
}


def transformer(a: Krea2Arch) -> Any:
    from diffusers import Krea2Transformer2DModel

    assert sum(a.axes_dims_rope) == a.head_dim, "Krea 2's rotary axes split the head dimension"
    return Krea2Transformer2DModel(
        in_channels=4 * 16,  # 16 latent channels packed 2x2
        num_layers=a.layers,
        attention_head_dim=a.head_dim,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        intermediate_size=a.intermediate,
        timestep_embed_dim=a.timestep_dim,
        text_hidden_dim=a.text.hidden,
        num_text_layers=len(a.select_layers),
        text_num_attention_heads=a.text_heads,
        text_num_key_value_heads=a.text_heads,
        text_intermediate_size=a.text_intermediate,
        axes_dims_rope=a.axes_dims_rope,
    )


def scheduler(a: Krea2Arch) -> Any:
    """Krea2Pipeline's: the resolution-aware exponential shift (the pipeline passes ``mu``)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=6400,
        time_shift_type="exponential",
    )


def pipeline(**parts: Any) -> Any:
    from diffusers import Krea2Pipeline

    return Krea2Pipeline(**parts)


def make(
    out: Path, arch: str, a: Krea2Arch, seed: int = 0, depth: int | None = None, configs_only: bool = False
) -> Path:
    """A random-weight ``Krea2Pipeline`` of ``a`` (``is_distilled`` as ``a.distilled``: a stand-in for Turbo)."""

    def krea2(**parts: Any) -> Any:
        return pipeline(**parts, text_encoder_select_layers=a.select_layers, is_distilled=a.distilled)

    parts = OpenParts(transformer, qwenimage.vae, scheduler, qwen3vl_encoder, krea2)
    return make_open_model(out, arch, a, parts, seed=seed, depth=depth, configs_only=configs_only)
