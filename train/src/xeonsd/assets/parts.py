"""Building blocks every offline pipeline shares: the KL autoencoder, the CLIP text encoders and their sizes, and
building modules in a given dtype."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from xeonsd.assets.vocab import BOS, EOS


@dataclass(frozen=True)
class Clip:
    """A CLIP text encoder's sizes."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    act: str = "quick_gelu"


CLIP_L = Clip(hidden=768, layers=12, heads=12, intermediate=3072)
CLIP_G = Clip(hidden=1280, layers=32, heads=20, intermediate=5120, act="gelu")  # OpenCLIP bigG
TINY_CLIP = Clip(hidden=32, layers=2, heads=4, intermediate=64)
TINY_CLIP_G = Clip(hidden=32, layers=2, heads=4, intermediate=64, act="gelu")


def vae_of(
    channels: tuple[int, ...], layers: int, norm_groups: int, sample_px: int, scaling: float, shift: float | None = None
) -> Any:
    """A KL autoencoder of these widths: SD's (4 latent channels); with ``shift``, FLUX.1's and SD3's (16 latent
    channels, a shift factor besides the scaling, no quant convs)."""
    from diffusers import AutoencoderKL

    flow = (
        {"latent_channels": 4}
        if shift is None
        else {"latent_channels": 16, "shift_factor": shift, "use_quant_conv": False, "use_post_quant_conv": False}
    )
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(channels),
        up_block_types=("UpDecoderBlock2D",) * len(channels),
        block_out_channels=channels,
        layers_per_block=layers,
        norm_num_groups=norm_groups,
        sample_size=sample_px,
        scaling_factor=scaling,
        **flow,
    )


def clip_model(c: Clip, vocab: dict[str, int], projection: bool) -> Any:
    """A random-weight CLIP text encoder of ``c``'s size over ``vocab``; ``projection``: with its pooled output's
    projection (``CLIPTextModelWithProjection``)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=c.hidden,
        intermediate_size=c.intermediate,
        num_hidden_layers=c.layers,
        num_attention_heads=c.heads,
        max_position_embeddings=77,
        hidden_act=c.act,
        projection_dim=c.hidden,
        bos_token_id=vocab[BOS],
        eos_token_id=vocab[EOS],
        pad_token_id=vocab[EOS],
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


@contextlib.contextmanager
def default_dtype(dtype: Any) -> Iterator[None]:
    """Build modules directly in ``dtype`` (a bf16 FLUX transformer never exists in fp32 here)."""
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
