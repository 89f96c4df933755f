"""The concept's token(s): added to the tokenizer, trained as their own small parameter, saved for diffusers.

Only ``num_vectors x hidden`` numbers are trained. The text encoder's embedding matrix stays frozen and
bit-identical; a thin module in front of it substitutes the trainable vectors for the placeholder ids. So the
gradient that is all-reduced every step is ``num_vectors x hidden`` floats, not the ``vocab x hidden`` matrix
(~152 MB for SD 1.5) that the recipe's script all-reduced and then partly reverted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from xeonsd.modelfiles.concept_file import expand_tokens, token_taken, write_concept_file

log = logging.getLogger(__name__)


class ConceptError(ValueError):
    """The placeholder or initializer token does not fit the tokenizer."""


@dataclass(frozen=True)
class Concept:
    tokens: list[str]
    ids: list[int]

    @property
    def prompt_text(self) -> str:
        """What stands for the concept in a training prompt."""
        return " ".join(self.tokens)


def add_concept(tokenizer, text_encoder, placeholder: str, initializer: str, num_vectors: int) -> Concept:
    """Add the placeholder token(s) to tokenizer and text encoder (``<tok>``, ``<tok>_1``, …: the names diffusers'
    ``load_textual_inversion`` gives multi-vector concepts; ``num_vectors`` >= 1, as --method textual_inversion
    checks); new rows start as the initializer's embedding."""
    tokens = expand_tokens(placeholder, num_vectors)
    vocab = tokenizer.get_vocab()
    taken = [t for t in tokens if token_taken(tokenizer, t, vocab)]
    if taken:
        raise ConceptError(
            f"placeholder token {taken[0]!r} is already in the tokenizer's vocabulary; choose another "
            "--placeholder_token (e.g. wrap it in angle brackets: '<my-concept>')"
        )
    init_ids = tokenizer.encode(initializer, add_special_tokens=False)
    if len(init_ids) != 1:
        pieces = tokenizer.convert_ids_to_tokens(init_ids)
        raise ConceptError(
            f"--initializer_token {initializer!r} must be exactly one token, but the tokenizer splits it into "
            f"{len(init_ids)}: {pieces}; choose a common single word"
        )
    added = tokenizer.add_tokens(tokens)
    if added != len(tokens):
        raise ConceptError(f"tokenizer added {added} of {len(tokens)} placeholder tokens {tokens}")
    ids = tokenizer.convert_tokens_to_ids(tokens)
    if ids != list(range(ids[0], ids[0] + len(ids))):
        raise ConceptError(f"placeholder ids {ids} are not contiguous")
    text_encoder.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        weight = text_encoder.get_input_embeddings().weight
        weight[ids] = weight[init_ids[0]].clone()
    return Concept(tokens=tokens, ids=ids)


class PlaceholderEmbedding(torch.nn.Module):
    """Token embedding with a frozen base table and trainable rows for a contiguous range of placeholder ids."""

    def __init__(self, base: torch.nn.Embedding, first_id: int, num_vectors: int) -> None:
        super().__init__()
        self.base = base
        self.base.weight.requires_grad_(False)
        self.first_id = first_id
        self.num_vectors = num_vectors
        init = base.weight[first_id : first_id + num_vectors].detach().clone().float()
        self.vectors = torch.nn.Parameter(init)

    @property
    def weight(self) -> torch.Tensor:
        # transformers reads ``get_input_embeddings().weight`` (dtype, shape); the base table answers for it.
        return self.base.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        emb = F.embedding(input_ids, self.base.weight)
        offset = input_ids - self.first_id
        mask = (offset >= 0) & (offset < self.num_vectors)
        picked = self.vectors[offset.clamp(0, self.num_vectors - 1)].to(emb.dtype)
        return torch.where(mask.unsqueeze(-1), picked, emb)

    def merged(self) -> torch.nn.Embedding:
        """A plain embedding with the trained vectors written into the placeholder rows (for saving)."""
        out = torch.nn.Embedding(self.base.num_embeddings, self.base.embedding_dim)
        with torch.no_grad():
            out.weight.copy_(self.base.weight)
            out.weight[self.first_id : self.first_id + self.num_vectors] = self.vectors.to(out.weight.dtype)
        return out


def save_learned_embeds(path: Path, placeholder: str, vectors: torch.Tensor | list[torch.Tensor]) -> Path:
    """Write ``{placeholder: [num_vectors, hidden]}`` (float32) in the format ``load_textual_inversion`` reads; for
    SDXL (a list of the two text encoders' vectors) one file with ``clip_l`` and ``clip_g``
    (:func:`xeonsd.modelfiles.concept_file.write_concept_file`)."""
    sets = vectors if isinstance(vectors, list) else [vectors]
    return write_concept_file(path, placeholder, [v.detach().to(torch.float32).numpy() for v in sets])
