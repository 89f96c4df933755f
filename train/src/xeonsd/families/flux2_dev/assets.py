"""FLUX.2 [dev]'s offline pipelines (``make-tiny-model --arch``): ``flux2-dev`` (its widths in bf16, ``--depth`` cuts
its 8 + 48 blocks and takes a thin text encoder of the real output width; ``--configs-only`` for the estimate, since
its 32B transformer and 24B text encoder fit no test machine) and ``tiny-flux2-dev`` (the same structure at 64 px, a
30-layer Mistral3 with a tiny Pixtral tower) for the tests. FLUX.2 [klein]'s transformer class, VAE and scheduler
(:mod:`xeonsd.families.flux2.assets`), with a guidance embedding; the Mistral text side is
:mod:`xeonsd.assets.mistral_text`'s."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from xeonsd.assets.mistral_text import MistralText, PixtralVision, mistral3_encoder, mistral_tokenizer
from xeonsd.assets.open_models import OpenArch, OpenParts, make_open_model
from xeonsd.families.flux2 import assets as klein

# Mistral-Small-3.2-24B-Instruct-2506: 40 layers, 32 heads x 128 (8 key/value), Pixtral's 24-layer tower.
MISTRAL_SMALL_24B = MistralText(
    hidden=5120,
    layers=40,
    heads=32,
    kv_heads=8,
    intermediate=32768,
    head_dim=128,
    vocab_size=131072,
    vision=PixtralVision(hidden=1024, layers=24, heads=16, intermediate=4096, patch_size=14, image_size=1540),
)
# What a ``--depth`` build takes instead (48 GB in bf16 fits no test machine): the same output width (5120, so the
# context is 3 x 5120) and 30 layers (hidden states 10, 20 and 30 are stacked), thin inside (8 heads, a 1024-wide
# MLP, the tokenizer's vocabulary, a 1-layer vision tower): 0.9 B parameters. The trainer encodes each caption once
# and frees the encoder before the transformer loads, so a step's time does not depend on it.
MISTRAL_SMALL_24B_THIN = dataclasses.replace(
    MISTRAL_SMALL_24B,
    layers=30,
    heads=8,
    kv_heads=2,
    intermediate=1024,
    vocab_size=None,
    vision=PixtralVision(hidden=64, layers=1, heads=2, intermediate=128, patch_size=14, image_size=1540),
)
CONFIGS_ONLY = True  # make-tiny-model --configs-only: the configs without weights
ARCHS: dict[str, OpenArch] = {
    # FLUX.2-dev: 8 double + 48 single blocks, 48 heads x 128, context = 3 x Mistral's 5120 (diffusers'
    # scripts/convert_flux2_to_diffusers.py).
    "flux2-dev": OpenArch(
        layers=8,
        single_layers=48,
        heads=48,
        head_dim=128,
        axes_dims_rope=(32, 32, 32, 32),
        text=MISTRAL_SMALL_24B,
        vae_channels=(128, 256, 512, 512),
        vae_layers=2,
        weights_dtype="bfloat16",
        cuts_depth=True,
        depth_text=MISTRAL_SMALL_24B_THIN,
    ),
    # The same structure at the tiny pipelines' size (64 px), for the tests: 30 text layers, as hidden state 30 is
    # stacked.
    "tiny-flux2-dev": OpenArch(
        layers=1,
        single_layers=2,
        heads=2,
        head_dim=16,
        axes_dims_rope=(4, 4, 4, 4),
        text=MistralText(
            hidden=32,
            layers=30,
            heads=2,
            kv_heads=1,
            intermediate=64,
            head_dim=16,
            vision=PixtralVision(hidden=16, layers=1, heads=2, intermediate=32, patch_size=16, image_size=64),
        ),
        vae_channels=(8, 8, 16, 16),
        vae_layers=1,
        norm_groups=8,
        sample_px=64,
    ),
}


def pipeline(**parts: Any) -> Any:
    from diffusers import Flux2Pipeline

    return Flux2Pipeline(**parts)


PARTS = OpenParts(
    functools.partial(klein.transformer, guidance_embeds=True),
    klein.vae,
    klein.scheduler,
    mistral3_encoder,
    pipeline,
    tokenizer=mistral_tokenizer,
)


def make(
    out: Path, arch: str, a: OpenArch, seed: int = 0, depth: int | None = None, configs_only: bool = False
) -> Path:
    """A random-weight ``Flux2Pipeline`` of ``a``."""
    return make_open_model(out, arch, a, PARTS, seed=seed, depth=depth, configs_only=configs_only)
