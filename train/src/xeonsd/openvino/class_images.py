"""Prior preservation's class images through OpenVINO (``xeonsd train --class_export DIR``).

The trainer generates missing class images from the base model; where an OpenVINO export of that base model exists
(``export.yml`` keeps one per base model), this module renders them through it instead of PyTorch. The trainer
may not import this package: the CLI hands it :func:`open_class_renderer`, and the trainer calls it only when
class images are missing (:mod:`xeonsd.trainer.prior`).

``DIR`` is an export, or a directory of exports (the base models' export cache): the first one, by name, made
from the base model itself (its manifest's ``source_fingerprint`` is the base model's fingerprint; no concept,
adapter or token merging in it). It is reshaped to one image per call at the training resolution, so any static
shape it was exported with will do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xeonsd.families import of_manifest
from xeonsd.openvino.manifest import MANIFEST, ExportDirError, read_manifest
from xeonsd.openvino.pipelines import ov_pipeline_class

log = logging.getLogger(__name__)

Renderer = Callable[[str, int], Any]  # (prompt, generator seed) -> a PIL image at the resolution it was opened for


def base_export(root: Path, fingerprint: str) -> tuple[Path, dict] | None:
    """(path, manifest) of the export of the base model with this fingerprint in ``root`` (itself an export, or a
    directory of them); None when there is none."""
    root = Path(root).expanduser()
    if not root.is_dir():
        return None
    candidates = [root] if (root / MANIFEST).is_file() else sorted(p for p in root.iterdir() if p.is_dir())
    for path in candidates:
        try:
            manifest = read_manifest(path, verify=False)
        except ExportDirError:
            continue
        plain = all(manifest.get(k) is None for k in ("embeds", "lora", "tome"))
        if plain and manifest.get("source_fingerprint") == fingerprint:
            return path, manifest
    return None


def open_class_renderer(root: Path, fingerprint: str, resolution: int, steps: int) -> tuple[Renderer, Path] | None:
    """A renderer over the base model's export in ``root``, compiled for one image of ``resolution`` px, and the
    export's path; None where ``root`` holds no export of this base model (the trainer then uses PyTorch)."""
    import torch

    found = base_export(root, fingerprint)
    if found is None:
        return None
    path, manifest = found
    pipe = ov_pipeline_class(of_manifest(manifest)).from_pretrained(str(path), dynamic_shapes=False, compile=False)
    pipe.reshape(batch_size=1, height=resolution, width=resolution, num_images_per_prompt=1)
    pipe.compile()
    pipe.set_progress_bar_config(disable=True)
    log.info("class images through the OpenVINO export %s at %d px", path, resolution)

    # FLUX.1/SD3: T5's prompt length the export fixed (FluxPipeline's default, 512, would not fit a shorter one)
    extra = (
        {} if manifest.get("max_sequence_length") is None else {"max_sequence_length": manifest["max_sequence_length"]}
    )

    def render(prompt: str, seed: int) -> Any:
        return pipe(
            prompt,
            **extra,
            num_inference_steps=steps,
            generator=torch.Generator("cpu").manual_seed(seed),
            height=resolution,
            width=resolution,
        ).images[0]

    return render, path
