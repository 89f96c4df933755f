"""``xeonsd serve --embeds FILE [--token TOKEN]``: a textual inversion concept served on the export.

OpenVINO GenAI 2026.4.1 takes no embeddings per request (only LoRA adapters), so at start-up the concept is added to
an overlay of the export's text encoder(s) and tokenizer(s) (:mod:`xeonsd.openvino.overlay`, what ``xeonsd generate
--engine genai --embeds`` loads) in the server's temporary directory, and every worker compiles the base, each
adapter and each blend from it (:attr:`~xeonsd.serve.options.ServedModel.models_dir`). :func:`read_concepts` refuses
a family without concepts (``FamilySpec.concept_layout``), a missing or unreadable file and a file of the other
layout (SDXL on SD, and the reverse) before any model is read; :func:`add_concepts` writes the overlay, refusing
vectors of another model's width and a token the tokenizer already has. Each is a one-line :class:`ServeError`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from xeonsd.serve.options import ServeError

if TYPE_CHECKING:
    from xeonsd.families import FamilySpec
    from xeonsd.modelfiles.concept_file import Concept
    from xeonsd.serve.options import ServedModel, ServeOptions


def read_concepts(opts: ServeOptions, family: FamilySpec) -> dict[str, Concept] | None:
    """``--embeds``' concept per text encoder (None without it), read before any model is."""
    from xeonsd.modelfiles.concept_file import ConceptError, load_concepts

    if opts.embeds is None:
        return None
    if family.concept_layout is None:
        raise ServeError(
            f"--embeds: {family.label} has no textual-inversion concepts (xeonsd trains and loads them for SD "
            "1.x/2.x and SDXL only); serve a LoRA of it instead"
        )
    try:
        return load_concepts(opts.embeds, opts.token, family)
    except ConceptError as e:
        raise ServeError(f"--embeds: {e}") from None


def add_concepts(served: ServedModel, concepts: dict[str, Concept], out: Path) -> None:
    """Write the overlay of the export holding ``concepts`` to ``out``, for every worker to compile from, and add the
    concept's tokens to the served model's."""
    from xeonsd.modelfiles.concept_file import ConceptError
    from xeonsd.openvino.overlay import write_overlay

    try:
        served.overlay = write_overlay(served.export_dir, out, served.family, concepts)
    except ConceptError as e:  # a vector size of another model, or a token the export already has
        raise ServeError(f"--embeds: {e}") from None
    served.concept_tokens = [*served.concept_tokens, *concepts["text_encoder"].tokens]
