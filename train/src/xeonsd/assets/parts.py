"""Building blocks every offline pipeline shares: the KL autoencoder and the CLIP text encoder's config."""

from __future__ import annotations

from typing import Any

from xeonsd.assets.vocab import BOS, EOS


def vae_of(
    channels: tuple[int, ...],
    layers: int,
    norm_groups: int,
    sample_px: int,
    scaling: float,
    latent_channels: int = 4,
    **flow: Any,
) -> Any:
    """A KL autoencoder of these widths; ``flow``: the FLUX/SD3 VAE's extras (``shift_factor``, no quant convs)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(channels),
        up_block_types=("UpDecoderBlock2D",) * len(channels),
        block_out_channels=channels,
        layers_per_block=layers,
        latent_channels=latent_channels,
        norm_num_groups=norm_groups,
        sample_size=sample_px,
        scaling_factor=scaling,
        **flow,
    )


def clip_config(vocab: dict[str, int], hidden: int, layers: int, heads: int, intermediate: int, act: str) -> Any:
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=77,
        hidden_act=act,
        projection_dim=hidden,
        bos_token_id=vocab[BOS],
        eos_token_id=vocab[EOS],
        pad_token_id=vocab[EOS],
    )
