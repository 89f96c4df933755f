"""Z-Image's training side (the family strategy :data:`TRAINING`), as diffusers' ``ZImagePipeline`` conditions the
model and ``train_dreambooth_lora_z_image.py`` (v0.39.0) trains it:

* the text: each prompt in the tokenizer's chat template (one user turn, the generation prompt, thinking on),
  padded to the pipeline's ``max_sequence_length`` (512), through Qwen3 with its attention mask; the second-last
  hidden state at the unpadded tokens is the prompt's caption features, one [L, cap_feat_dim] tensor of its own
  length per prompt. The table keeps each prompt's L rows at the front of a padded [max_sequence_length, D] row,
  with its length, so the class prompt's rows join the instance ones in one tensor; the transformer gets the
  per-example list cut to each length, as the pipeline passes it;
* the latents are the VAE's ``latent_dist.mode()`` (the mean: the script does not sample), then
  ``(z - shift_factor) * scaling_factor``; each goes to the transformer as its own [C, 1, H, W] frame;
* the timestep input is ``(1000 - t) / 1000`` of the scheduler's timestep t = σ·N (the transformer scales it by
  its ``t_scale``), and the model's output is negated: it predicts x₀ − ε, the script trains −output against the
  velocity ε − x₀;
* σ from the scheduler's training grid with its static shift (3), the script's default weighting ``none``;
  LoRA's default layers: the attention projections ``to_q``, ``to_k``, ``to_v``, ``to_out.0`` (in the main
  layers and the noise and context refiners alike).
"""

from __future__ import annotations

import torch

from xeonsd.families.flow import FlowFamily, FlowPromptConditioning, held
from xeonsd.families.training import VAEView
from xeonsd.families.zimage import SPEC


class ZImagePromptConditioning(FlowPromptConditioning):
    """The prompt table through Qwen3: ``encode(rows)`` gives (caption features [n, max_sequence_length, D], each
    prompt's rows first and zeros after, their lengths [n]). Qwen3 is the one, frozen, text encoder: every row is
    encoded once at start-up (:meth:`_encode_frozen`), then the encoder is freed."""

    def _tokenize(self, texts: list[str]) -> list[torch.Tensor]:
        """[input ids, attention mask] of the chat-templated prompts (ZImagePipeline._encode_prompt)."""
        enc = self._chat(texts, thinking=True)
        return [enc.input_ids, enc.attention_mask]

    def _qwen(self, ids: list[torch.Tensor]) -> torch.Tensor:
        """The second-last hidden state at each prompt's unpadded tokens, moved to the front of its row."""
        encoder = held(self.models.text_encoder, "Qwen3")
        input_ids, mask = ids[0], ids[1].bool()
        with torch.no_grad():
            hidden = encoder(input_ids=input_ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2]
        out = torch.zeros_like(hidden)
        for i in range(hidden.shape[0]):
            out[i, : int(mask[i].sum())] = hidden[i][mask[i]]
        return out

    def _encode_frozen(self, rank: int, world: int) -> None:
        self.long = self._encode_rows(rank, world, lambda ids: (self._qwen(ids),))[0]
        self.lengths = self.ids[1].sum(dim=1)

    def _encode_all(self, rank: int, world: int) -> tuple[torch.Tensor, ...]:
        return ()  # no CLIP side: the Qwen table is all there is

    def _forward(self, ids: list[torch.Tensor], long: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """(caption features, lengths) of freshly tokenized prompts (--shuffle_tags, Qwen3 kept)."""
        return (self._qwen(ids) if long is None else long), ids[1].sum(dim=1)

    def encode(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.long[rows], self.lengths[rows]

    def unet_inputs(self, latents, examples) -> tuple[torch.Tensor, dict]:
        """The padded caption features, and each example's length (``lengths``)."""
        hidden, lengths = self.for_examples(examples)
        return hidden, {"lengths": lengths.long()}

    def pipeline_kwargs(self, prompt: str) -> dict:
        """ZImagePipeline's ``prompt_embeds`` (row 0, ``prompt``) and ``negative_prompt_embeds`` (row 1, the empty
        prompt), each a list of one unpadded [L, D] tensor."""
        assert self.prompts.texts[0] == prompt, "the sample conditioning holds another prompt"
        hidden, lengths = self.encode([0, 1])
        embeds = [h[: int(n)] for h, n in zip(hidden, lengths, strict=True)]
        return {"prompt_embeds": embeds[:1], "negative_prompt_embeds": embeds[1:]}


class ZImageFamily(FlowFamily):
    """Z-Image (Turbo and base): one Qwen3 text encoder, a single-stream transformer with noise and caption
    refiners, taking lists of per-sample tensors."""

    spec = SPEC
    conditioning = ZImagePromptConditioning
    lora_targets = ("to_k", "to_q", "to_v", "to_out.0")  # train_dreambooth_lora_z_image.py's default

    def latent_vae(self, vae):
        return VAEView(vae, mode=True)

    def denoiser_kwargs(self, config, noisy, sigmas, hidden, pooled, added, flow):
        lengths = added.get("lengths")
        caps = list(hidden.unbind(0))
        if lengths is not None:
            caps = [h[: int(n)] for h, n in zip(caps, lengths, strict=True)]
        timesteps = sigmas.float() * flow.num_train_timesteps  # the scheduler's training timesteps
        return {
            "x": list(noisy.unsqueeze(2).unbind(0)),  # [C, 1, H, W] each
            "t": (1000 - timesteps) / 1000,
            "cap_feats": caps,
        }

    def unpack(self, pred, shape):
        """The per-example [C, 1, H, W] outputs stacked, negated ("z-Image negates the prediction")."""
        return -torch.stack(pred, dim=0).squeeze(2)

    def text_dims(self, config) -> tuple[int, int]:
        return int(config.cap_feat_dim), 0

    def blocks(self, denoiser) -> list[torch.nn.Module]:
        return [*denoiser.noise_refiner, *denoiser.context_refiner, *denoiser.layers]


TRAINING = ZImageFamily()
