"""An overlay of an export: a directory that GenAI loads as the export, whose CLIP text encoders (and tokenizers)
also hold a learned concept and, on SDXL, the text-encoder part of LoRA adapters.

OpenVINO GenAI 2026.4.1 takes a prompt as text and applies nothing per request but LoRA adapters: its
``generate`` has no prompt embeddings, its ``ImageGenerationConfig`` no embeddings field, and its text encoder
(``CLIPTextModel``) reads its graph and tokenizer when it is built. So a concept must be in the text encoder's graph
and the tokenizer a pipeline is built from. :func:`write_overlay` writes exactly those (each edited text encoder's
IR, its ``config.json``, and with a concept its tokenizer, in both the transformers and OpenVINO tokenizer files)
and links every other entry to the export's own (the denoiser and the VAE are not copied). ``xeonsd generate
--engine genai --embeds`` (:class:`xeonsd.openvino.engines.GenaiEngine`) and ``xeonsd serve --embeds``
(:func:`xeonsd.serve.prepare.prepare`) build their pipelines from it.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xeonsd.families import FamilySpec
    from xeonsd.modelfiles.concept_file import Concept

log = logging.getLogger(__name__)


def write_overlay(
    ov_dir: Path,
    out: Path,
    family: FamilySpec,
    concepts: Mapping[str, Concept] | None = None,
    text_loras: Sequence[tuple[Sequence[Any], float]] = (),
) -> Path:
    """Write ``out`` (a new directory) as an overlay of the export ``ov_dir`` and return it.

    ``concepts``: the concept per text encoder (:func:`xeonsd.modelfiles.concept_file.load_concepts`), added to each
    CLIP text encoder and its tokenizer (a concept that does not fit, or whose token the tokenizer already has, is a
    :class:`~xeonsd.modelfiles.concept_file.ConceptError`); ``text_loras``: (LoRA modules, alpha) whose text-encoder
    modules are added to the CLIP text encoders' weights (SDXL: see :mod:`xeonsd.openvino.pipelines`)."""
    import openvino as ov

    from xeonsd.openvino import pipelines
    from xeonsd.openvino.lora_files import PREFIXES

    ov_dir, out = Path(ov_dir), Path(out)
    out.mkdir()
    sides = [(enc, tok) for enc, tok in family.text_side if enc in family.clip_encoders]
    edited = {enc for enc, _ in sides} | ({tok for _, tok in sides} if concepts else set())
    for entry in ov_dir.iterdir():
        if entry.name not in edited:
            (out / entry.name).symlink_to(entry.resolve())
    for encoder, tokenizer in sides:
        model = ov.Core().read_model(ov_dir / encoder / "openvino_model.xml")
        if concepts:
            _add_concept(ov_dir, out, tokenizer, model, concepts[encoder])
        prefix = PREFIXES[encoder]  # the kohya prefix of its LoRA modules: lora_te_, lora_te2_
        for modules, alpha in text_loras:
            pipelines.fuse_into_ir(model, [m for m in modules if m.name.startswith(prefix)], alpha)
        (out / encoder).mkdir()
        ov.save_model(model, out / encoder / "openvino_model.xml", compress_to_fp16=False)
        shutil.copy(ov_dir / encoder / "config.json", out / encoder / "config.json")
    log.info("overlay of %s in %s (%s)", ov_dir, out, ", ".join(sorted(edited)))
    return out


def _add_concept(ov_dir: Path, out: Path, tokenizer_dir: str, model: Any, concept: Concept) -> None:
    from transformers import CLIPTokenizer

    from xeonsd.modelfiles.concept_file import add_to_openvino
    from xeonsd.openvino import tokenizer as ovtokenizer

    tokenizer = CLIPTokenizer.from_pretrained(ov_dir / tokenizer_dir)
    add_to_openvino(tokenizer, model, concept)
    tokenizer.save_pretrained(out / tokenizer_dir)
    ovtokenizer.save(tokenizer, out, tokenizer_dir)
