"""The text conditioning of the training steps: the prompt table's token ids, run through the text encoder.

A method that trains the text encoder (textual inversion's vectors, LoRA on the text encoder) needs the forward
pass every step. Otherwise the encoder is frozen and each prompt's hidden states are computed once before the
first step (shared out over the ranks like the latent cache), so a step pays nothing for its captions.

The caption draws (:class:`~xeonsd.trainer.captions.CaptionDraws`) keep that: with ``--caption_dropout`` alone an
example sees its caption or the empty one, so the table gets one more row, the empty caption's. ``--shuffle_tags``
makes more orders than a table can hold (n tags: n! of them), so each example's shuffled caption goes through the
frozen encoder in the step, without gradient (one text-encoder forward per example; docs/trainer.md has its cost).
"""

from __future__ import annotations

import torch

from xeonsd.cluster.distributed import all_reduce_sum_
from xeonsd.trainer.captions import CaptionDraws
from xeonsd.trainer.data import Example
from xeonsd.trainer.models import Models, autocast
from xeonsd.trainer.prompt_tables import PromptTable

ENCODE_BATCH = 16  # prompts per text encoder call while the table is built


class PromptConditioning:
    """The prompt table through the text encoder: ``encode(rows)`` gives the hidden states [n, 77, hidden].
    :class:`~xeonsd.families.sdxl.training.XLPromptConditioning` overrides the four hooks (``_tokenize``, ``_select``,
    ``_forward``, ``_encode_all``) for SDXL's two encoders; the caption draws are the same code for both."""

    def __init__(
        self,
        models: Models,
        prompts: PromptTable,
        trainable: bool,
        rank: int,
        world: int,
        draws: CaptionDraws | None = None,
    ) -> None:
        self.models = models
        self.prompts = prompts
        self.trainable = trainable
        self.draws = draws or CaptionDraws()
        texts = [self.draws.fixed(t) for t in prompts.texts]
        if self.draws.dropout > 0:
            texts.append("")  # the empty caption's row: len(prompts.texts)
        self.ids = self._tokenize(texts)
        self._encode_frozen(rank, world)
        self.rank, self.world = rank, world
        # encoders still to load (a flow family's CLIP ones, loaded in phases): finish() builds the table then
        self.table = None if trainable or models.text_pending else self._encode_all(rank, world)

    def finish(self) -> None:
        """The table, once :meth:`Models.load_pending` loaded the encoders it waited for."""
        if self.table is None and not self.trainable:
            self.table = self._encode_all(self.rank, self.world)

    def _encode_frozen(self, rank: int, world: int) -> None:
        """Encode, whatever the method, what no method trains (FLUX's and SD3's T5); nothing for CLIP-only families."""

    def _tokenize(self, texts: list[str]) -> torch.Tensor:
        tok = self.models.tokenizer
        return tok(
            texts, padding="max_length", truncation=True, max_length=tok.model_max_length, return_tensors="pt"
        ).input_ids

    def _select(self, rows: list[int]):
        """The token ids of these prompt rows."""
        return self.ids[rows]

    def _forward(self, ids):
        with autocast(self.models.weight_dtype):
            return self.models.text_encoder(ids)[0]

    @torch.no_grad()
    def _encode_all(self, rank: int, world: int):
        n = self.ids.shape[0]
        if n < world:  # fewer prompts than ranks (an instance prompt): every rank encodes them
            return self._forward(self.ids).float()
        mine = list(range(rank, n, world))
        table: torch.Tensor | None = None
        for k in range(0, len(mine), ENCODE_BATCH):
            rows = mine[k : k + ENCODE_BATCH]
            hidden = self._forward(self._select(rows)).float()
            if table is None:
                table = torch.zeros((n, *hidden.shape[1:]), dtype=torch.float32)
            table[rows] = hidden
        return all_reduce_sum_(table, world)

    def encode(self, rows: list[int]):
        """These prompt rows as validation sees them (nothing drawn)."""
        if self.table is not None:
            return self.table[rows]
        return self._forward(self._select(rows))

    def unet_inputs(self, latents, examples: list[Example]) -> tuple[torch.Tensor, dict | None]:
        """What the UNet call takes for these examples besides the latents: the encoder hidden states (with the
        caption draws) and the family's ``added_cond_kwargs`` (None here)."""
        return self.for_examples(examples), None

    def for_examples(self, examples: list[Example]):
        """What these training examples condition on: their prompt rows, with the caption draws."""
        rows = [self.prompts.row(e) for e in examples]
        if not self.draws.shuffle_tags:
            empty = len(self.prompts.texts)
            return self.encode(
                [empty if self.draws.dropped(e.index) else r for r, e in zip(rows, examples, strict=True)]
            )
        ids = self._tokenize(
            [self.draws.text(self.prompts.texts[r], e.index) for r, e in zip(rows, examples, strict=True)]
        )
        if self.trainable:
            return self._forward(ids)
        with torch.no_grad():
            out = self._forward(ids)
        return tuple(t.float() for t in out) if isinstance(out, tuple) else out.float()
