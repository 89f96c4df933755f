"""Qwen-Image-Edit-2511's offline pipelines (``make-tiny-model --arch``): ``qwenimage-edit`` (Qwen-Image's widths
in bf16, ``--depth`` cuts its 60 blocks) for benchmarks, ``tiny-qwenimage-edit`` (the same structure at 64 px) for
the tests: Qwen-Image's parts (:mod:`xeonsd.families.qwenimage.assets`) with 2511's ``zero_cond_t`` transformer, in
a ``QwenImageEditPlusPipeline`` with its ``processor/`` folder (:mod:`.processor`)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from xeonsd.assets.open_models import OpenArch, OpenParts, make_open_model
from xeonsd.assets.open_text import qwen25vl_encoder
from xeonsd.families.qwenimage import assets as qwen

CONFIGS_ONLY = True  # make-tiny-model --configs-only: the configs without weights
ARCHS: dict[str, OpenArch] = {
    "qwenimage-edit": qwen.ARCHS["qwenimage"],
    "tiny-qwenimage-edit": qwen.ARCHS["tiny-qwenimage"],
}


def pipeline(**parts: Any) -> Any:
    from diffusers import QwenImageEditPlusPipeline

    return QwenImageEditPlusPipeline(**parts, processor=None)  # its processor/ folder: finish()


def finish(out: Path, tokenizer: Any) -> None:
    """The ``processor/`` folder, named in model_index.json as the released pipelines name it."""
    from xeonsd.families.qwenimage_edit.processor import write_processor  # transformers: only when one is made

    write_processor(out / "processor", tokenizer)
    index = json.loads((out / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


PARTS = OpenParts(
    functools.partial(qwen.transformer, zero_cond_t=True), qwen.vae, qwen.scheduler, qwen25vl_encoder, pipeline, finish
)


def make(
    out: Path, arch: str, a: OpenArch, seed: int = 0, depth: int | None = None, configs_only: bool = False
) -> Path:
    """A random-weight ``QwenImageEditPlusPipeline`` of ``a``."""
    return make_open_model(out, arch, a, PARTS, seed=seed, depth=depth, configs_only=configs_only)
