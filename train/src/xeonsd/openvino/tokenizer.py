"""The OpenVINO tokenizer model that ``openvino_genai.Text2ImagePipeline`` needs, with the concept token(s) intact.

optimum-intel 2.2 writes no ``openvino_tokenizer.xml`` for a diffusers pipeline; ``openvino_tokenizers``
``convert_tokenizer`` does. For CLIP it has one trap with a concept: CLIP's BPE appends the end-of-word suffix
``</w>`` to every word, and the converted tokenizer appends it to an added token too, so ``"a <dicoo> robot"``
becomes ``[…, <dicoo>, <, /, w, >, robot, …]``, four stray tokens after every concept token. The conversion below
also registers ``<tok></w>`` under the same id, which the BPE step then matches whole, and checks the result
against the transformers tokenizer, so the genai engine sees exactly the ids the diffusers pipeline sees.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from xeonsd.openvino.manifest import OV_TOKENIZER

log = logging.getLogger(__name__)


class TokenizerConversionError(RuntimeError):
    """The OpenVINO tokenizer does not reproduce the transformers tokenizer."""


def concept_tokens(tokenizer: Any) -> list[str]:
    """Added tokens that are not special tokens: the concept(s) a pipeline was given."""
    specials = set(tokenizer.all_special_tokens)
    added = sorted(tokenizer.get_added_vocab().items(), key=lambda kv: kv[1])
    return [tok for tok, _ in added if tok not in specials]


@contextlib.contextmanager
def _suffix_added_tokens(tokens: list[str]) -> Iterator[None]:
    """While converting, give each added token a ``<tok></w>`` alias in the BPE step (see the module docstring)."""
    from openvino_tokenizers import hf_parser
    from openvino_tokenizers.tokenizer_pipeline import BPETokenizationStep

    base = hf_parser.TransformersTokenizerPipelineParser

    class _Parser(base):  # type: ignore[misc, valid-type]
        def parse(self):  # noqa: ANN202 - same signature as the base class
            pipeline = super().parse()
            for step in pipeline.steps:
                if isinstance(step, BPETokenizationStep) and step.end_suffix and step.added_tokens:
                    for tok in tokens:
                        if tok in step.added_tokens:
                            step.added_tokens[tok + step.end_suffix] = step.added_tokens[tok]
            return pipeline

    hf_parser.TransformersTokenizerPipelineParser = _Parser
    try:
        yield
    finally:
        hf_parser.TransformersTokenizerPipelineParser = base


def convert(tokenizer: Any) -> Any:
    """An ``openvino.Model`` tokenizing like ``tokenizer`` (checked on a probe prompt with every concept token)."""
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer

    tokens = concept_tokens(tokenizer)
    with _suffix_added_tokens(tokens):
        model = convert_tokenizer(tokenizer, with_detokenizer=False)
    probe = "a photo of " + " ".join(f"{t} x{t}y" for t in tokens) + " at the beach, high quality"
    want = tokenizer(probe).input_ids
    got = ov.compile_model(model, "CPU")([probe])["input_ids"][0].tolist()
    if got != want:
        raise TokenizerConversionError(
            f"the converted OpenVINO tokenizer gives {got} for {probe!r}, the transformers tokenizer {want}"
        )
    return model


def save(tokenizer: Any, out_dir: Path, folder: str = "tokenizer") -> Path:
    """Write ``<folder>/openvino_tokenizer.xml`` (+ .bin) for ``tokenizer`` under ``out_dir`` (SDXL: ``tokenizer``
    and ``tokenizer_2``)."""
    import openvino as ov

    path = Path(out_dir) / folder / OV_TOKENIZER.name
    path.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(convert(tokenizer), path)
    return path
