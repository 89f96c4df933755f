"""What the flow-matching transformer families (FLUX.1: :mod:`.flux`, SD3/SD3.5: :mod:`.sd3`) share: the
rectified-flow objective (:mod:`xeonsd.trainer.flow`) and a text side of CLIP encoders beside a T5 encoder.

The text encoders are frozen (a method may put LoRA adapters on the CLIP ones, never on T5). Each prompt's T5
hidden states are computed once at start-up, each rank encoding its share of the table and one all-reduce per
chunk of rows giving every rank all of them, kept in the training dtype; the CLIP side is cached the same way,
or run every step when its adapters train. Once every table the run needs is built, T5 (4.7 B parameters in
FLUX.1 and SD3.5) is freed (:meth:`FlowFamily.release_long_encoder`), unless ``--shuffle_tags`` makes captions that no table holds.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from xeonsd.cluster.distributed import all_reduce_sum_
from xeonsd.families.training import TrainFamily
from xeonsd.trainer.conditioning import PromptConditioning
from xeonsd.trainer.data import Example
from xeonsd.trainer.flow import flow_loss, noisy_input
from xeonsd.trainer.models import Models, autocast

log = logging.getLogger("xeonsd.train")

ENCODE_ROWS = 16  # prompts per all-reduce while the tables are built (bounds the fp32 transient)
# LoRA's default targets on these transformers: the image stream's and the text stream's attention projections
# (diffusers' train_dreambooth_lora_sd3.py's default; its FLUX.1 script adds the feed-forward layers too)
ATTENTION_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


def held(encoder, name: str):
    """The long text encoder, still loaded: a caption outside the prompt tables needs it once it was freed."""
    if encoder is None:
        raise RuntimeError(f"{name} was freed; a caption outside the prompt tables cannot be encoded")
    return encoder


def _rss_gb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024**2
    return 0.0


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[b, c, h, w] -> [b, h/2 * w/2, 4c]: each 2x2 patch one token (FluxPipeline._pack_latents)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of :func:`pack` for a latent of h x w."""
    b, _, channels = tokens.shape
    x = tokens.view(b, h // 2, w // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, channels // 4, h, w)


class FlowPromptConditioning(PromptConditioning):
    """The prompt table through CLIP and T5: ``encode(rows)`` gives (the denoiser's text hidden states, the pooled
    CLIP embedding). A family defines ``_clip`` (what its CLIP encoders give) and ``_combine`` (with T5's hidden
    states, what the transformer takes)."""

    def _encode_frozen(self, rank: int, world: int) -> None:
        self.long = self._encode_rows(rank, world, lambda ids: (self._t5(ids[-1]),))[0]

    def _encode_all(self, rank: int, world: int) -> tuple[torch.Tensor, ...]:
        return self._encode_rows(rank, world, lambda ids: self._clip(ids[:-1]))

    # ---- the encoders ----------------------------------------------------------------------------------------
    def _tokenize(self, texts: list[str]) -> list[torch.Tensor]:
        out = []
        pairs = self.models.text_pairs
        for i, (tok, _) in enumerate(pairs):
            length = self.models.text_length if i == len(pairs) - 1 else tok.model_max_length
            out.append(
                tok(texts, padding="max_length", truncation=True, max_length=length, return_tensors="pt").input_ids
            )
        return out

    def _select(self, rows: list[int]) -> list[torch.Tensor]:
        return [ids[rows] for ids in self.ids]

    def _t5(self, ids: torch.Tensor) -> torch.Tensor:
        encoder = held(self.models.text_pairs[-1][1], "T5")
        with torch.no_grad():
            return encoder(ids, output_hidden_states=False)[0]

    def _chat(self, texts: list[str], thinking: bool):
        """Qwen3's tokens of the prompts in its chat template (one user turn, the generation prompt, ``thinking``
        on or off), padded to the text length: FLUX.2 [klein] and Z-Image prompt it the same way."""
        tok = self.models.tokenizer
        chat = [
            tok.apply_chat_template(
                [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True, enable_thinking=thinking
            )
            for t in texts
        ]
        return tok(chat, padding="max_length", truncation=True, max_length=self.models.text_length, return_tensors="pt")

    def _clip(self, ids: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """What the family's CLIP encoders give for these token ids (each a [n, ...] tensor)."""
        raise NotImplementedError

    def _combine(self, clip: tuple[torch.Tensor, ...], t5: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(text hidden states, pooled embedding) for the transformer, from the CLIP part and T5's hidden states."""
        raise NotImplementedError

    def _forward(self, ids: list[torch.Tensor], long: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        with autocast(self.models.weight_dtype):
            clip = self._clip(ids[:-1])
        return self._combine(clip, self._t5(ids[-1]) if long is None else long)

    @torch.no_grad()
    def _encode_rows(self, rank: int, world: int, encode) -> tuple[torch.Tensor, ...]:
        """``encode(ids)`` of every row of the table: each rank encodes its share, ENCODE_ROWS rows to an
        all-reduce (fp32), kept in the training dtype."""
        n = self.ids[0].shape[0]
        store = self.models.weight_dtype
        if n < world:  # fewer prompts than ranks (an instance prompt): every rank encodes them
            with autocast(store):
                return tuple(t.to(store) for t in encode(self.ids))
        tables: list[torch.Tensor] | None = None
        for first in range(0, n, ENCODE_ROWS):
            rows = list(range(first, min(first + ENCODE_ROWS, n)))
            parts: list[torch.Tensor] | None = None
            for j, row in enumerate(rows):
                if row % world != rank:
                    continue
                with autocast(store):
                    out = encode(self._select([row]))
                if parts is None:
                    parts = [torch.zeros((len(rows), *t.shape[1:]), dtype=torch.float32) for t in out]
                for p, t in zip(parts, out, strict=True):
                    p[j] = t[0].float()
            if parts is None:  # this rank has no row in this chunk: learn the shapes from one row, unreduced
                with autocast(store):
                    out = encode(self._select([rows[0]]))
                parts = [torch.zeros((len(rows), *t.shape[1:]), dtype=torch.float32) for t in out]
            if tables is None:
                tables = [torch.zeros((n, *p.shape[1:]), dtype=store) for p in parts]
            for table, p in zip(tables, parts, strict=True):
                table[first : first + len(rows)] = all_reduce_sum_(p, world).to(store)
        assert tables is not None
        return tuple(tables)

    def encode(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.table is not None:
            return self._combine(tuple(t[rows] for t in self.table), self.long[rows])
        return self._forward(self._select(rows), self.long[rows])

    def unet_inputs(self, latents, examples: list[Example]) -> tuple[torch.Tensor, dict]:
        """The text hidden states, and the pooled CLIP embedding (``pooled``)."""
        hidden, pooled = self.for_examples(examples)
        return hidden, {"pooled": pooled}

    def pipeline_kwargs(self, prompt: str) -> dict:
        """The pipeline's prompt arguments for row 0 of this table (``prompt``) and row 1 (the empty negative)."""
        assert self.prompts.texts[0] == prompt, "the sample conditioning holds another prompt"
        hidden, pooled = self.encode([0, 1])
        kwargs = {"prompt_embeds": hidden[:1], "pooled_prompt_embeds": pooled[:1]}
        return {**kwargs, **self._negative(hidden[1:], pooled[1:])}

    def _negative(self, hidden: torch.Tensor, pooled: torch.Tensor) -> dict:
        """The empty prompt's embeddings, for a pipeline with classifier-free guidance (SD3); none for FLUX.1."""
        return {}


class FlowFamily(TrainFamily):
    """The rectified-flow objective on a transformer. A family defines how its transformer is called
    (``denoiser_kwargs`` from the noisy latents, σ and the text; ``unpack`` of the prediction) and, for the memory
    estimate and the FLOP counts, the shapes of its inputs (``latent_dims``, ``text_dims``, ``meta_inputs``) and
    the blocks whose saved activations repeat (``blocks``)."""

    is_flow = True
    lora_targets = ATTENTION_TARGETS

    @property
    def resolution_shift(self) -> bool:
        """σ of a scheduler with use_dynamic_shifting follows the image's token count (FLUX.1: xeonsd.trainer.flow);
        False: the scheduler's unshifted training grid, the sigmas diffusers' Qwen-Image and FLUX.2 scripts index
        (``FamilySpec.resolution_shift``, which the models' loading reads)."""
        return self.spec.resolution_shift

    def predict(self, models, denoiser, latents, noise, t, hidden, added, channels_last=False):
        """(the velocity the transformer predicts, ε − x₀) for latents noised to σ = ``t``."""
        noisy = noisy_input(latents, noise, t)
        dtype = models.unet_dtype
        pooled = added.get("pooled") if added else None
        pooled = None if pooled is None else pooled.to(dtype)
        assert models.flow is not None
        with autocast(models.weight_dtype) if models.unet_autocast else contextlib.nullcontext():
            kwargs = self.denoiser_kwargs(
                denoiser.config, noisy.to(dtype), t, hidden.to(dtype), pooled, added or {}, models.flow
            )
            pred = denoiser(**kwargs, return_dict=False)[0]
        return self.unpack(pred, noisy.shape), noise - latents

    def denoiser_kwargs(self, config, noisy, sigmas, hidden, pooled, added: dict, flow) -> dict:
        """The transformer's keyword arguments for latents ``noisy`` [b, c, h, w] at σ = ``sigmas``, the text's
        hidden states and pooled embedding (None where the family has none) and the rest of the conditioning
        (``added``: what the family's prompt conditioning returned besides the hidden states); ``flow`` is the
        run's :class:`xeonsd.trainer.flow.FlowSchedule` (its ``num_train_timesteps``, ``guidance``)."""
        raise NotImplementedError

    def unpack(self, pred: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The transformer's output back in the latents' ``shape`` (FLUX: unpacked from tokens)."""
        return pred

    def text_dims(self, config) -> tuple[int, int]:
        """(width of the text hidden states, width of the pooled embedding; 0: none) the transformer takes."""
        return int(config.joint_attention_dim), int(getattr(config, "pooled_projection_dim", None) or 0)

    def meta_inputs(
        self, config, batch: int, dims: tuple[int, int, int], text_len: int, dtype, references: int = 0
    ) -> dict:
        """One training call's keyword arguments on the meta device (call it under ``torch.device("meta")``), for
        latents of ``dims`` and ``text_len`` text tokens (``references``: with that many reference images of the
        same size, edit training): what the memory estimate and the FLOP count run."""
        from xeonsd.trainer.flow import FlowSchedule

        hidden_dim, pooled_dim = self.text_dims(config)
        noisy = torch.zeros(batch, *dims, dtype=dtype)
        hidden = torch.zeros(batch, text_len, hidden_dim, dtype=dtype)
        pooled = torch.zeros(batch, pooled_dim, dtype=dtype) if pooled_dim else None
        flow = FlowSchedule("none", 0.0, 1.0, 1.29, 1000, 1.0, False)
        added = {"references": tuple(torch.zeros_like(noisy) for _ in range(references))} if references else {}
        return self.denoiser_kwargs(config, noisy, torch.zeros(batch, dtype=dtype), hidden, pooled, added, flow)

    def blocks(self, denoiser) -> list[torch.nn.Module]:
        """The transformer's repeated blocks (the memory estimate watches each one's saved activations)."""
        return [*denoiser.transformer_blocks, *getattr(denoiser, "single_transformer_blocks", [])]

    def release_long_encoder(self, models: Models, keep: bool) -> None:
        """Free a flow family's long text encoder (T5, or the one Qwen encoder) once every prompt table is built
        (``keep``: --shuffle_tags still needs it), logging its class and this process's resident memory before and
        after."""
        slot = next(s for s in ("text_encoder_3", "text_encoder_2", "text_encoder") if getattr(models, s) is not None)
        name = type(getattr(models, slot)).__name__
        if keep:
            log.info("%s stays loaded: --shuffle_tags encodes each example's caption in the step", name)
            return
        before = _rss_gb()
        models.free(slot)
        log.info("%s freed: every prompt is encoded; resident memory %.2f GB -> %.2f GB", name, before, _rss_gb())

    def loss(self, models, pred, target, t, snr_gamma, mask=None):
        assert models.flow is not None
        return flow_loss(pred, target, models.flow.weights(t), mask)
