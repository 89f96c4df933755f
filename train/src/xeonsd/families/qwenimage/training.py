"""Qwen-Image's training side (the family strategy :data:`TRAINING`), as diffusers' ``QwenImagePipeline`` runs the
model and ``train_dreambooth_lora_qwen_image.py`` (v0.39.0) trains it:

* the text: each prompt in the pipeline's chat template, through Qwen2.5-VL; its last hidden states without the
  template's system prefix (the first ``drop_idx`` = 34 tokens), at most the pipeline's ``max_sequence_length``
  tokens, with their attention mask (``encoder_hidden_states_mask``, the pipeline's ``prompt_embeds_mask``). Each
  prompt is encoded alone once at start-up (as the script encodes its instance and class prompts), then Qwen is
  freed (:meth:`xeonsd.families.flow.FlowFamily.release_long_encoder`). A table holds its rows padded to its longest prompt, with the masks; a
  step's batch is padded to the longest prompt of the batch, and the mask is dropped where no row has padding (as
  the pipeline's ``encode_prompt`` and the script's ``concat_prompt_embedding_batches`` do). No pooled embedding;
* the latents: the Wan-style 3D VAE takes [n, c, frames, h, w]: the cache encodes single frames through
  :class:`~xeonsd.families.training.VAEView` and normalises them per channel, ``(z - latents_mean) / latents_std``;
* the transformer call: the latents packed 2x2 into tokens (``_pack_latents``), ``img_shapes`` of (1, h/2, w/2),
  the timestep input σ (the pipeline's and the script's ``timestep / 1000``), no guidance input (a guidance-embedding
  config would get ``--guidance_scale``); the prediction unpacked again;
* σ: the script draws it from the scheduler's unshifted training grid (the released scheduler shifts dynamically,
  so ``noise_scheduler.sigmas`` stay unshifted; ``shift_terminal`` only applies at inference), hence the
  spec's ``resolution_shift=False``; the default weighting is the script's ``none``;
* LoRA's default targets: the script's ``to_k, to_q, to_v, to_out.0`` (the image stream's attention).

Neither textual inversion nor ``--train_text_encoder`` applies (:func:`xeonsd.trainer.inputs.check_family_flags`
refuses both: there is no CLIP encoder).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xeonsd.families.flow import FlowFamily, FlowPromptConditioning, held, pack, unpack
from xeonsd.families.qwenimage import SPEC
from xeonsd.families.training import VAEView
from xeonsd.trainer.models import autocast

# QwenImagePipeline's prompt template and the length of its system prefix (prompt_template_encode(_start_idx)),
# and the tokenizer limit it encodes with (tokenizer_max_length)
TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
DROP_IDX = 34
TOKENIZER_MAX_LENGTH = 1024


class QwenPromptConditioning(FlowPromptConditioning):
    """The prompt table through Qwen2.5-VL: ``encode(rows)`` gives (hidden states [n, L, d], mask [n, L]), L the
    longest of these rows; ``unet_inputs`` gives the hidden states padded to the model's text length with the mask
    in ``added["mask"]`` (so the prior-preservation batch joins the class rows to the instance rows)."""

    template = TEMPLATE  # the pipeline's prompt template, and the length of its system prefix
    drop_idx = DROP_IDX

    # ---- the token ids: [input ids, attention mask], right-padded to the table's longest templated prompt ----
    def _tokenize(self, texts: list[str]) -> list[torch.Tensor]:
        tok = self.models.tokenizer
        out = tok(
            [self.template.format(t) for t in texts],
            max_length=TOKENIZER_MAX_LENGTH + self.drop_idx,
            padding=True,
            truncation=True,
            return_tensors="pt",
        )
        return [out.input_ids, out.attention_mask]

    def _width(self, mask: torch.Tensor) -> int:
        """Text tokens a row of these masks gives at most: after the prefix, at most the text length."""
        return max(1, min(int(mask.sum(dim=1).max()) - self.drop_idx, self.models.text_length))

    def _qwen(self, ids: list, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states, mask) of these rows, each encoded alone (no padding in its forward), padded to
        ``width`` (default: the longest of them). ``ids[2]``, where there is one: each row's images for the vision
        tower (``pixel_values``, ``image_grid_thw``; Qwen-Image-Edit's reference images)."""
        encoder = held(self.models.text_encoder, "Qwen2.5-VL")
        input_ids, mask = ids[:2]
        images = ids[2] if len(ids) > 2 else [{}] * len(input_ids)
        width = width or self._width(mask)
        rows = []
        with torch.no_grad():
            for one, m, seen in zip(input_ids, mask, images, strict=True):
                n = int(m.sum())
                one = one[m.bool()][None]  # the row's own tokens (right or left padding alike)
                body = getattr(encoder, "model", encoder)  # the decoder without the LM head: the same states
                out = body(input_ids=one, attention_mask=torch.ones_like(one), output_hidden_states=True, **seen)
                rows.append(out.hidden_states[-1][0, self.drop_idx : n][:width])
        hidden = torch.stack([F.pad(r, (0, 0, 0, width - r.shape[0])) for r in rows])
        lengths = torch.tensor([r.shape[0] for r in rows])
        return hidden, (torch.arange(width)[None] < lengths[:, None]).to(hidden.dtype)

    def _encode_frozen(self, rank: int, world: int) -> None:
        width = self._width(self.ids[1])
        self.long = self._encode_rows(rank, world, lambda ids: self._qwen(ids, width))

    def _encode_all(self, rank: int, world: int):
        return self.long  # no CLIP side: Qwen's table is the whole table

    def _forward(self, ids: list[torch.Tensor], long=None) -> tuple[torch.Tensor, torch.Tensor]:
        with autocast(self.models.weight_dtype):
            return self._qwen(ids)

    def encode(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, mask = self.long
        hidden, mask = hidden[rows], mask[rows]
        width = max(1, int(mask.sum(dim=1).max()))
        return hidden[:, :width], mask[:, :width]

    def unet_inputs(self, latents, examples) -> tuple[torch.Tensor, dict]:
        """The hidden states padded to the text length, and their mask (``mask``)."""
        hidden, mask = self.for_examples(examples)
        pad = self.models.text_length - hidden.shape[1]
        return F.pad(hidden, (0, 0, 0, pad)), {"mask": F.pad(mask, (0, pad))}

    def pipeline_kwargs(self, prompt: str) -> dict:
        """``prompt_embeds`` and ``prompt_embeds_mask`` of row 0 (``prompt``); no negative: the script's validation
        and our class images run QwenImagePipeline without true CFG (no negative prompt)."""
        assert self.prompts.texts[0] == prompt, "the sample conditioning holds another prompt"
        hidden, mask = self.encode([0])
        return {"prompt_embeds": hidden, "prompt_embeds_mask": mask.to(torch.long)}


def trimmed(hidden: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The text padded to the longest prompt of the batch; no mask where no row has padding."""
    if mask is None:
        return hidden, None
    width = max(1, int(mask.sum(dim=1).max()))
    hidden, mask = hidden[:, :width], mask[:, :width]
    return hidden, None if bool(mask.all()) else mask.to(torch.long)


class QwenImageFamily(FlowFamily):
    """Qwen-Image (MMDiT, Qwen2.5-VL text, Wan-style 3D VAE)."""

    spec = SPEC
    conditioning = QwenPromptConditioning
    lora_targets = ("to_k", "to_q", "to_v", "to_out.0")

    def latent_dims(self, vae_config, vae_scale, height, width):
        return int(vae_config.z_dim), height // vae_scale, width // vae_scale

    def latent_vae(self, vae):
        return VAEView(vae, frames=True)

    def latent_affine(self, vae):
        c = vae.config
        mean = torch.tensor(c.latents_mean, dtype=torch.float32).view(c.z_dim, 1, 1)
        std = torch.tensor(c.latents_std, dtype=torch.float32).view(c.z_dim, 1, 1)
        return mean, 1.0 / std

    def denoiser_kwargs(self, config, noisy, sigmas, hidden, pooled, added, flow):
        b, _, h, w = noisy.shape
        dtype = noisy.dtype
        hidden, mask = trimmed(hidden, added.get("mask"))
        guidance = torch.full((b,), flow.guidance, dtype=dtype) if config.guidance_embeds else None
        return {
            "hidden_states": pack(noisy),
            "encoder_hidden_states": hidden,
            "encoder_hidden_states_mask": mask,
            "timestep": sigmas.to(dtype),
            "img_shapes": [(1, h // 2, w // 2)] * b,
            "guidance": guidance,
        }

    def unpack(self, pred, shape):
        return unpack(pred, shape[-2], shape[-1])

    def text_dims(self, config) -> tuple[int, int]:
        return int(config.joint_attention_dim), 0


TRAINING = QwenImageFamily()
