"""Offline assets built from code: a Stable Diffusion pipeline with random weights and a small image set.

Nothing can be downloaded in tests, so these stand in for the Hub model and the dicoo images:

* ``tiny``: a pipeline small enough to train in seconds, with the same structure as SD 1.x (4-level VAE with
  scale factor 8, cross-attention UNet, CLIP text encoder) and a tokenizer that knows the recipe's
  initializer word ``toy`` as one token.
* ``tiny-v``: the tiny pipeline in the SD 2.x style (v-prediction, linear attention projections, per-level
  head dims, GELU text encoder), for the tests of SD 2.x training.
* ``sd15``: the full SD 1.5 architecture (UNet ~860M parameters, 49,408-token vocabulary, VAE, CLIP-L text
  encoder) with random weights: the same FLOPs and memory as the real model, for realistic benchmarks.
* ``sd21``: the full SD 2.1 (768-v) architecture (UNet ~865M parameters, OpenCLIP-H-sized text encoder,
  v-prediction) with random weights, for benchmarks.
* ``tiny-flux`` / ``tiny-sd3``: FLUX.1-dev and SD3.5-medium in miniature (flow matching, a transformer denoiser,
  16-channel VAE, CLIP + T5 text encoders), for the tests; ``flux`` (with ``--depth``) and ``sd35m``: their full
  widths in bf16, for benchmarks (:mod:`.flow_models`).
* ``tiny-flux2`` / ``tiny-zimage`` / ``tiny-qwenimage``: FLUX.2-klein-4B, Z-Image-Turbo and Qwen-Image in miniature
  (flow matching, Qwen3 or Qwen2.5-VL text encoders, a Qwen tokenizer built from the tiny word list), for the
  tests; ``flux2-klein``, ``zimage``, ``qwenimage`` (each with ``--depth``): their full widths in bf16, for
  benchmarks (:mod:`.open_models`); ``tiny-flux2-dev`` / ``flux2-dev``: FLUX.2 [dev] the same way, with a Mistral3
  text encoder and a Tekken-style tokenizer (:mod:`.mistral_text`).

The image set can come with captions in each layout the trainer reads (see :mod:`xeonsd.trainer.captions`).

Each arch lives in its family's folder (``xeonsd/families/<name>/assets.py``: its ``ARCHS`` and ``make``), built with
the shared parts here. Modules: :mod:`.vocab` (the CLIP-style vocabulary and tokenizer), :mod:`.models` (the
``--arch`` lookup, the UNet pipelines' :class:`~xeonsd.assets.models.Arch` and builder), :mod:`.flow_models` (the
FLUX.1 and SD3 builder), :mod:`.open_models`, :mod:`.open_text` and :mod:`.mistral_text` (the builder of the
Qwen-encoder families and FLUX.2 [dev], their Qwen and Mistral text sides),
:mod:`.parts` (the VAE and the CLIP encoders they share), :mod:`.datasets` (the image sets).

Besides the random-weight ones, the demo's *pretrained* pipeline (``xeonsd make-demo-model``, :mod:`.demo_model`):
an SD 1.x pipeline at 64 px that draws the captioned scenes of :mod:`.scenes` ("a red ball on grass"), shipped in
``demo_model/``, on which a trained concept shows in the pictures.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# What the package offers, by the module that has it: imported on first use, so that the ``--arch`` choices of the
# command line (:func:`.models.arch_names`) read the family folders' tables without loading numpy and PIL.
_EXPORTS = {
    "CAPTION_LAYOUTS": "datasets",
    "make_dataset": "datasets",
    "make_pairs": "datasets",
    "PAIRS_PROMPT": "datasets",
    "Arch": "models",
    "arch_names": "models",
    "make_tiny_model": "models",
    "make_demo_model": "demo_model",
    "build_clip_vocab": "vocab",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"xeonsd.assets.{_EXPORTS[name]}"), name)


__all__ = sorted(_EXPORTS)
