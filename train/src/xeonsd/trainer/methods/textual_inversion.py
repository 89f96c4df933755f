"""Textual inversion: only the concept's token vectors learn (``num_vectors x hidden`` numbers).

The vectors are their own small parameter in front of the frozen embedding table (see
:mod:`xeonsd.trainer.embeddings`), so the all-reduced gradient is a few KB. ``--train_full_embedding_matrix`` is the
recipe's way, kept as the benchmark's baseline: the whole table trains and every row but the concept's is reset
after each step. SDXL has two text encoders: the concept gets its tokens and vectors in each (768 and 1280 wide),
saved in one file as ``clip_l`` and ``clip_g`` (:mod:`xeonsd.modelfiles.concept_file`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from xeonsd.contracts.method_names import result_file
from xeonsd.templates import templates_for
from xeonsd.trainer.checkpoint import CheckpointError
from xeonsd.trainer.config import ConfigError
from xeonsd.trainer.data import DataError
from xeonsd.trainer.embeddings import PlaceholderEmbedding, add_concept, save_learned_embeds
from xeonsd.trainer.methods.base import Method
from xeonsd.trainer.pipelines import save_full_pipeline
from xeonsd.trainer.prompt_tables import PromptTable

if TYPE_CHECKING:
    from xeonsd.trainer.captions import Captions

EMBEDS_FILE = result_file("textual_inversion")


class TextualInversion(Method):
    name = "textual_inversion"
    outputs = (EMBEDS_FILE,)
    trains_unet = False
    prompt_source = "the prompt templates"

    @classmethod
    def check(cls, cfg, captions: Captions | None) -> None:
        for flag in ("placeholder_token", "initializer_token"):
            if not getattr(cfg, flag):
                raise ConfigError(f"--method textual_inversion needs --{flag}")
        if cfg.num_vectors < 1:
            raise ConfigError(f"--num_vectors must be at least 1, got {cfg.num_vectors}")
        if cls.uses_captions(cfg, captions):
            assert captions is not None
            cls.check_captions(cfg, captions, "or train on the templates with --captions off")

    @classmethod
    def check_captions(cls, cfg, captions: Captions, where: str = "") -> None:
        """Every caption names the concept: the placeholder is what trains. ``where``: how to fix it, added."""
        for text, file in zip(captions.texts, captions.where, strict=True):
            if cfg.placeholder_token not in text:
                fix = f"; every caption must name the concept ({where})" if where else ""
                raise DataError(
                    f"{file}: the caption {text!r} does not contain the placeholder {cfg.placeholder_token}{fix}"
                )

    @classmethod
    def memory_trainable(cls, cfg, unet, encoders, family=None) -> int:
        """One vector set per text encoder (the whole embedding table with --train_full_embedding_matrix)."""
        return sum(
            (c.vocab_size if cfg.train_full_embedding_matrix else cfg.num_vectors) * c.hidden_size for c, _ in encoders
        )

    def label(self) -> str:
        return self.cfg.placeholder_token

    def __init__(self, cfg, models) -> None:
        super().__init__(cfg, models)
        # One vector set per text encoder (SDXL: two, 768 and 1280 wide), for the same placeholder tokens.
        self.slots = [_Slot(cfg, tokenizer, encoder) for tokenizer, encoder in models.text_pairs]
        self.concept = self.slots[0].concept

    @property
    def trains_text_encoder(self) -> bool:
        return True  # the gradient flows through it to the vectors

    def parameters(self) -> list[torch.nn.Parameter]:
        return [slot.trainable for slot in self.slots]

    def prompts(self, captions: Captions | None) -> PromptTable:
        text = self.concept.prompt_text  # "<tok> <tok>_1 …" for a multi-vector concept
        if self.uses_captions(self.cfg, captions):
            assert captions is not None
            texts = tuple(c.replace(self.cfg.placeholder_token, text) for c in captions.texts)
            return PromptTable(texts, per_image=True, source=captions.source)
        templates = templates_for(self.cfg.learnable_property)
        return PromptTable(
            tuple(t.format(text) for t in templates), per_image=False, source=f"{self.cfg.learnable_property} templates"
        )

    def vectors(self) -> list[torch.Tensor]:
        """The learned vectors, one [num_vectors, hidden] tensor per text encoder."""
        return [slot.vectors() for slot in self.slots]

    def _written(self) -> torch.Tensor | list[torch.Tensor]:
        """What the result file holds: the one tensor (SD), or the two (SDXL: clip_l and clip_g)."""
        vectors = self.vectors()
        return vectors[0] if len(vectors) == 1 else vectors

    def after_step(self, step: int) -> None:
        for slot in self.slots:
            slot.after_step()

    def periodic_save(self, out: Path, step: int) -> None:
        if self.cfg.save_steps and step % self.cfg.save_steps == 0:
            save_learned_embeds(
                out / f"learned_embeds-steps-{step}.safetensors", self.cfg.placeholder_token, self._written()
            )

    def state(self) -> dict:
        vectors = self.vectors()
        extra = {"vectors_2": vectors[1]} if len(vectors) > 1 else {}
        return {"vectors": vectors[0], **extra, "placeholder_tokens": self.concept.tokens}

    def load_state(self, state: dict, where: str) -> None:
        if state["placeholder_tokens"] != self.concept.tokens:
            raise CheckpointError(
                f"checkpoint {where} was trained for {state['placeholder_tokens']}, not {self.concept.tokens}"
            )
        saved = [state["vectors"]] + ([state["vectors_2"]] if "vectors_2" in state else [])
        if len(saved) != len(self.slots):
            raise CheckpointError(
                f"checkpoint {where} holds vectors for {len(saved)} text encoder(s), this model has {len(self.slots)}"
            )
        for slot, vectors in zip(self.slots, saved, strict=True):
            slot.load(vectors)

    def save(self, out: Path) -> None:
        if self.cfg.save_as_full_pipeline:
            names = (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2"))
            parts = {}
            for (tok_name, enc_name), (tokenizer, encoder) in zip(names, self.models.text_pairs, strict=False):
                parts.update({tok_name: tokenizer, enc_name: encoder})
            save_full_pipeline(self.cfg, out, self.models.family, **parts)
        save_learned_embeds(out / EMBEDS_FILE, self.cfg.placeholder_token, self._written())

    def summary(self) -> dict:
        return {
            **super().summary(),
            "trainable_params": sum(self.cfg.num_vectors * slot.trainable.shape[-1] for slot in self.slots),
            "placeholder_tokens": self.concept.tokens,
        }


class _Slot:
    """The concept in one text encoder: its tokens added, and what trains (the vectors in front of the frozen table,
    or the recipe's whole matrix with every other row reset after each step)."""

    def __init__(self, cfg, tokenizer, text_encoder) -> None:
        self.full_matrix = cfg.train_full_embedding_matrix
        self.concept = add_concept(
            tokenizer, text_encoder, cfg.placeholder_token, cfg.initializer_token, cfg.num_vectors
        )
        base = text_encoder.get_input_embeddings()
        if self.full_matrix:
            self.trainable = base.weight
            self.trainable.requires_grad_(True)
            self.frozen_rows = base.weight.detach().clone()
            self.keep_mask = torch.ones(self.trainable.shape[0], dtype=torch.bool)
            self.keep_mask[self.concept.ids] = False
        else:
            module = PlaceholderEmbedding(base, self.concept.ids[0], cfg.num_vectors)
            text_encoder.set_input_embeddings(module)
            self.trainable = module.vectors

    def vectors(self) -> torch.Tensor:
        v = self.trainable[self.concept.ids] if self.full_matrix else self.trainable
        return v.detach().clone()

    def after_step(self) -> None:
        if self.full_matrix:
            with torch.no_grad():  # the recipe's way: undo the update on every row but the placeholders
                self.trainable[self.keep_mask] = self.frozen_rows[self.keep_mask]

    def load(self, vectors: torch.Tensor) -> None:
        with torch.no_grad():
            if self.full_matrix:
                self.trainable[self.concept.ids] = vectors.to(self.trainable.dtype)
            else:
                self.trainable.copy_(vectors)
