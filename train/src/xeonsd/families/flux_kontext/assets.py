"""FLUX.1 Kontext's offline pipeline (``make-tiny-model --arch tiny-flux-kontext``): FLUX.1's tiny structure (its
transformer, CLIP-L, T5, VAE and scheduler: :mod:`xeonsd.families.flux.assets`) in a ``FluxKontextPipeline``, for
the tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from xeonsd.assets.flow_models import FlowArch, make_flow_model
from xeonsd.families.flux import assets as flux

ARCHS: dict[str, FlowArch] = {"tiny-flux-kontext": flux.ARCHS["tiny-flux"]}


def pipeline(*, clip_l: Any, clip_g: Any, t5: Any, t5_tokenizer: Any, **parts: Any) -> Any:
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**parts, text_encoder=clip_l, text_encoder_2=t5, tokenizer_2=t5_tokenizer)


def make(
    out: Path, arch: str, a: FlowArch, seed: int = 0, depth: int | None = None, configs_only: bool = False
) -> Path:
    """A random-weight ``FluxKontextPipeline`` of ``a``."""
    return make_flow_model(out, arch, a, flux.transformer, flux.scheduler, pipeline, seed=seed, depth=depth)
