"""FLUX.1 Kontext's offline pipelines (``make-tiny-model --arch``): FLUX.1's structures (its transformer, CLIP-L, T5,
VAE and scheduler: :mod:`xeonsd.families.flux.assets`) in a ``FluxKontextPipeline``: ``flux-kontext`` at FLUX.1
[dev]'s widths (Kontext [dev] has them; ``--depth`` cuts its 19 + 38 blocks) for the benchmarks, ``tiny-flux-kontext``
for the tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from xeonsd.assets.flow_models import FlowArch, make_flow_model
from xeonsd.families.flux import assets as flux

ARCHS: dict[str, FlowArch] = {"flux-kontext": flux.ARCHS["flux"], "tiny-flux-kontext": flux.ARCHS["tiny-flux"]}


def pipeline(*, clip_l: Any, clip_g: Any, t5: Any, t5_tokenizer: Any, **parts: Any) -> Any:
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**parts, text_encoder=clip_l, text_encoder_2=t5, tokenizer_2=t5_tokenizer)


def make(
    out: Path, arch: str, a: FlowArch, seed: int = 0, depth: int | None = None, configs_only: bool = False
) -> Path:
    """A random-weight ``FluxKontextPipeline`` of ``a``."""
    return make_flow_model(out, arch, a, flux.transformer, flux.scheduler, pipeline, seed=seed, depth=depth)
