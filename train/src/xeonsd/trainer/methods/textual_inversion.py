"""Textual inversion: only the concept's token vectors learn (``num_vectors x hidden`` numbers).

The vectors are their own small parameter in front of the frozen embedding table (see
:mod:`xeonsd.trainer.embeddings`), so the all-reduced gradient is a few KB. ``--train_full_embedding_matrix`` is the
recipe's way, kept as the benchmark's baseline: the whole table trains and every row but the concept's is reset
after each step.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from xeonsd.method_names import result_file
from xeonsd.trainer.checkpoint import CheckpointError
from xeonsd.trainer.config import ConfigError
from xeonsd.trainer.data import DataError
from xeonsd.trainer.embeddings import PlaceholderEmbedding, add_concept, save_learned_embeds
from xeonsd.trainer.methods.base import Method
from xeonsd.trainer.models import save_full_pipeline
from xeonsd.trainer.prompts import PromptTable, templates_for

if TYPE_CHECKING:
    from xeonsd.trainer.captions import Captions

EMBEDS_FILE = result_file("textual_inversion")


class TextualInversion(Method):
    name = "textual_inversion"
    outputs = (EMBEDS_FILE,)

    @classmethod
    def check(cls, cfg, captions: Captions | None) -> None:
        for flag in ("placeholder_token", "initializer_token"):
            if not getattr(cfg, flag):
                raise ConfigError(f"--method textual_inversion needs --{flag}")
        if cfg.num_vectors < 1:
            raise ConfigError(f"--num_vectors must be at least 1, got {cfg.num_vectors}")
        if cls.uses_captions(cfg, captions):
            assert captions is not None
            for text, where in zip(captions.texts, captions.where, strict=True):
                if cfg.placeholder_token not in text:
                    raise DataError(
                        f"{where}: the caption {text!r} does not contain the placeholder {cfg.placeholder_token}; "
                        "every caption must name the concept (or train on the templates with --captions off)"
                    )

    def __init__(self, cfg, models) -> None:
        super().__init__(cfg, models)
        te = models.text_encoder
        self.concept = add_concept(models.tokenizer, te, cfg.placeholder_token, cfg.initializer_token, cfg.num_vectors)
        base = te.get_input_embeddings()
        if cfg.train_full_embedding_matrix:
            self.trainable = base.weight
            self.trainable.requires_grad_(True)
            self.frozen_rows = base.weight.detach().clone()
            self.keep_mask = torch.ones(self.trainable.shape[0], dtype=torch.bool)
            self.keep_mask[self.concept.ids] = False
        else:
            module = PlaceholderEmbedding(base, self.concept.ids[0], cfg.num_vectors)
            te.set_input_embeddings(module)
            self.trainable = module.vectors

    @property
    def trains_text_encoder(self) -> bool:
        return True  # the gradient flows through it to the vectors

    def parameters(self) -> list[torch.nn.Parameter]:
        return [self.trainable]

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

    def vectors(self) -> torch.Tensor:
        v = self.trainable[self.concept.ids] if self.cfg.train_full_embedding_matrix else self.trainable
        return v.detach().clone()

    def after_step(self, step: int) -> None:
        if self.cfg.train_full_embedding_matrix:
            with torch.no_grad():  # the recipe's way: undo the update on every row but the placeholders
                self.trainable[self.keep_mask] = self.frozen_rows[self.keep_mask]

    def periodic_save(self, out: Path, step: int) -> None:
        if self.cfg.save_steps and step % self.cfg.save_steps == 0:
            save_learned_embeds(
                out / f"learned_embeds-steps-{step}.safetensors", self.cfg.placeholder_token, self.vectors()
            )

    def state(self) -> dict:
        return {"vectors": self.vectors(), "placeholder_tokens": self.concept.tokens}

    def load_state(self, state: dict, where: str) -> None:
        if state["placeholder_tokens"] != self.concept.tokens:
            raise CheckpointError(
                f"checkpoint {where} was trained for {state['placeholder_tokens']}, not {self.concept.tokens}"
            )
        with torch.no_grad():
            if self.cfg.train_full_embedding_matrix:
                self.trainable[self.concept.ids] = state["vectors"].to(self.trainable.dtype)
            else:
                self.trainable.copy_(state["vectors"])

    def save(self, out: Path) -> None:
        if self.cfg.save_as_full_pipeline:
            save_full_pipeline(self.cfg, out, tokenizer=self.models.tokenizer, text_encoder=self.models.text_encoder)
        save_learned_embeds(out / EMBEDS_FILE, self.cfg.placeholder_token, self.vectors())

    def summary(self) -> dict:
        return {
            **super().summary(),
            "trainable_params": self.cfg.num_vectors * self.trainable.shape[-1],
            "placeholder_tokens": self.concept.tokens,
        }
