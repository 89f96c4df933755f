"""Krea 2's training side (the family strategy :data:`TRAINING`), as diffusers' ``Krea2Pipeline`` runs the model and
``train_dreambooth_lora_krea2.py`` (diffusers' examples, read at 58eb52c) trains it:

* the text: each prompt after Qwen-Image's system prefix, then the template's assistant suffix, through Qwen3-VL
  (``Qwen3VLModel``) with positions that count the prompt's own tokens; the hidden states of the pipeline's
  ``text_encoder_select_layers`` (from model_index.json: ``Family.pipeline_config``) stacked per token, [L, K, D],
  without the prefix's 34 tokens. The pipeline pads every prompt to a fixed ``max_sequence_length`` in the middle of
  the template (``[prefix | prompt | PAD | suffix]``) and masks the padding; here each prompt is encoded alone with its
  suffix straight after it, and a table row holds its tokens first, its mask marking them. The transformer cannot
  tell the two apart: its text tokens all sit at rotary position 0 and its text blocks have no positions, so only
  which tokens are valid counts, and the padding, masked, adds nothing. A step's batch is cut to its longest prompt,
  the mask dropped where no row has padding (Qwen-Image's :func:`~xeonsd.families.qwenimage.training.trimmed`);
* the latents: Qwen-Image's VAE (``AutoencoderKLQwenImage``), single frames normalised per channel (the
  script's ``(z - latents_mean) / latents_std``), as :mod:`xeonsd.families.qwenimage.training`;
* the transformer call: the latents packed 2x2 into tokens (``_pack_latents``), the position ids of
  ``Krea2Pipeline.prepare_position_ids`` (text at the origin, image tokens at (0, row, column)), the timestep
  input σ in fp32 (the script's ``timesteps / 1000``), the boolean text mask; the prediction is the velocity
  ε − x₀, unpacked again;
* σ: the script draws it from the scheduler's unshifted training grid (``noise_scheduler_copy.sigmas``: the
  released scheduler shifts dynamically, by resolution, at inference only), hence ``resolution_shift=False``;
  its default weighting ``none``;
* LoRA's default targets: the script's default layer set (the Krea 2 authors' recommendation): the image input,
  the final projection, each block's attention (q, k, v, out and the output gate) and feed-forward (up, down), the
  text fusion's projector, the text projection, and the time embedding and modulation.

Validation on Turbo (``--inference_model``, the script's ``--validation_model_path``): the checkpoint's
``is_distilled`` gives the script's Turbo recipe, 8 steps without guidance (:meth:`Krea2Family.sampling`).
Neither textual inversion nor ``--train_text_encoder`` applies (no CLIP encoder).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xeonsd.families.flow import held, pack, unpack
from xeonsd.families.krea2 import SPEC
from xeonsd.families.qwenimage.training import DROP_IDX, QwenImageFamily, QwenPromptConditioning, trimmed

# Krea2Pipeline's prompt template: the system prefix (its first DROP_IDX = 34 tokens, dropped) and the assistant
# suffix, which it counts as 5 tokens when it cuts a long prompt (prompt_template_encode_num_suffix_tokens)
PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
SUFFIX_TOKENS = 5
# Krea2Pipeline's default taps (Qwen3-VL-4B's hidden states 2, 5, …, 35), where model_index.json names none
SELECT_LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)


def position_ids(text_len: int, h: int, w: int) -> torch.Tensor:
    """Krea2Pipeline.prepare_position_ids for ``text_len`` text tokens and a latent of h x w (h/2 x w/2 tokens)."""
    image = torch.zeros(h // 2, w // 2, 3)
    image[..., 1] = torch.arange(h // 2)[:, None]
    image[..., 2] = torch.arange(w // 2)[None, :]
    return torch.cat([torch.zeros(text_len, 3), image.reshape(-1, 3)], dim=0)


class Krea2PromptConditioning(QwenPromptConditioning):
    """The prompt table through Qwen3-VL: ``encode(rows)`` gives (hidden states [n, L, K, D], mask [n, L]), L the
    longest of these rows, K the tapped layers; ``unet_inputs`` pads them to the text length with the mask in
    ``added["mask"]``."""

    @property
    def _layers(self) -> tuple[int, ...]:
        family = self.models.family
        config = dict(family.pipeline_config) if family is not None else {}
        return tuple(config.get("text_encoder_select_layers") or SELECT_LAYERS)

    def _suffix(self) -> list[int]:
        return self.models.tokenizer(SUFFIX).input_ids

    @property
    def _text_width(self) -> int:
        """Text tokens a prompt gives at most: the pipeline's ``max_sequence_length`` (with a tokenizer whose suffix
        is not 5 tokens, that many more or fewer)."""
        return self.models.text_length - SUFFIX_TOKENS + len(self._suffix())

    def _tokenize(self, texts: list[str]) -> list[torch.Tensor]:
        """[input ids, attention mask]: each prompt after the prefix, cut where the pipeline cuts it, its suffix
        straight after it; right-padded to the longest."""
        tok = self.models.tokenizer
        limit = self.models.text_length + DROP_IDX - SUFFIX_TOKENS
        body = tok([PREFIX + t for t in texts], max_length=limit, truncation=True).input_ids
        suffix = self._suffix()
        rows = [torch.tensor(ids + suffix) for ids in body]
        width = max(len(r) for r in rows)
        pad = tok.pad_token_id
        input_ids = torch.stack([F.pad(r, (0, width - len(r)), value=pad) for r in rows])
        mask = (torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
        return [input_ids, mask]

    def _width(self, mask: torch.Tensor) -> int:
        return max(1, int(mask.sum(dim=1).max()) - DROP_IDX)

    def _qwen(self, ids: list[torch.Tensor], width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(stacked hidden states, mask) of these rows, each encoded alone, padded to ``width`` (default: the
        longest of them)."""
        encoder = held(self.models.text_encoder, "Qwen3-VL")
        input_ids, mask = ids[:2]
        width = width or self._width(mask)
        layers = self._layers
        rows = []
        with torch.no_grad():
            for one, m in zip(input_ids, mask, strict=True):
                one = one[m.bool()][None]
                n = one.shape[1]
                positions = torch.arange(n)[None].expand(3, 1, n)  # the pipeline's count of valid tokens, 3 axes
                out = encoder(
                    input_ids=one,
                    attention_mask=torch.ones_like(one),
                    position_ids=positions,
                    output_hidden_states=True,
                )
                stacked = torch.stack([out.hidden_states[i][0] for i in layers], dim=1)  # [n, K, D]
                rows.append(stacked[DROP_IDX:][:width])
        hidden = torch.stack([F.pad(r, (0, 0, 0, 0, 0, width - r.shape[0])) for r in rows])
        lengths = torch.tensor([r.shape[0] for r in rows])
        return hidden, (torch.arange(width)[None] < lengths[:, None]).to(hidden.dtype)

    def unet_inputs(self, latents, examples) -> tuple[torch.Tensor, dict]:
        """The hidden states padded to the text width, and their mask (``mask``)."""
        hidden, mask = self.for_examples(examples)
        pad = self._text_width - hidden.shape[1]
        return F.pad(hidden, (0, 0, 0, 0, 0, pad)), {"mask": F.pad(mask, (0, pad))}

    def pipeline_kwargs(self, prompt: str) -> dict:
        """``prompt_embeds`` and its mask for row 0 (``prompt``), and the negative ones for row 1 (the empty
        prompt): Krea2Pipeline runs classifier-free guidance whenever ``guidance_scale`` > 0."""
        assert self.prompts.texts[0] == prompt, "the sample conditioning holds another prompt"
        hidden, mask = self.encode([0, 1])
        mask = mask.bool()
        return {
            "prompt_embeds": hidden[:1],
            "prompt_embeds_mask": mask[:1],
            "negative_prompt_embeds": hidden[1:],
            "negative_prompt_embeds_mask": mask[1:],
        }


class Krea2Family(QwenImageFamily):
    """Krea 2 (single-stream DiT, Qwen3-VL's tapped layers, Qwen-Image's VAE): Qwen-Image's latents."""

    spec = SPEC
    conditioning = Krea2PromptConditioning
    lora_targets = (
        "img_in",
        "final_layer.linear",
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "to_gate",
        "ff.up",
        "ff.down",
        "text_fusion.projector",
        "txt_in.linear_1",
        "txt_in.linear_2",
        "time_embed.linear_1",
        "time_embed.linear_2",
        "time_mod_proj",
    )

    def denoiser_kwargs(self, config, noisy, sigmas, hidden, pooled, added, flow):
        b, _, h, w = noisy.shape
        hidden, mask = trimmed(hidden, added.get("mask"))
        return {
            "hidden_states": pack(noisy),
            "encoder_hidden_states": hidden,
            "timestep": sigmas.float(),  # the script's timesteps / 1000, in fp32 (the time embedding's dtype)
            "position_ids": position_ids(hidden.shape[1], h, w).to(noisy.device),
            "encoder_attention_mask": None if mask is None else mask.bool(),
        }

    def unpack(self, pred, shape):
        return unpack(pred, shape[-2], shape[-1])

    def text_dims(self, config) -> tuple[int, int]:
        """Per text token, the K tapped layers' states side by side (what a table row holds); no pooled input."""
        return int(config.num_text_layers) * int(config.text_hidden_dim), 0

    def meta_inputs(self, config, batch, dims, text_len, dtype, references=0) -> dict:
        kwargs = super().meta_inputs(config, batch, dims, text_len, dtype, references)
        hidden = kwargs["encoder_hidden_states"]
        shape = (*hidden.shape[:2], int(config.num_text_layers), int(config.text_hidden_dim))
        kwargs["encoder_hidden_states"] = hidden.view(shape)
        return kwargs

    def sampling(self, pipeline_config: dict) -> dict:
        """Turbo (``is_distilled``): the script's validation recipe for it, 8 steps without guidance."""
        if pipeline_config.get("is_distilled"):
            return {"num_inference_steps": 8, "guidance_scale": 0.0}
        return super().sampling(pipeline_config)


TRAINING = Krea2Family()
