"""FLUX.2 [klein]'s training side (the family strategy :data:`TRAINING`), as diffusers' ``Flux2KleinPipeline`` runs
the model and ``train_dreambooth_lora_flux2_klein.py`` (v0.39.0) trains it:

* the text: each prompt in the tokenizer's chat template (one user turn, the generation prompt, thinking off),
  padded to the pipeline's ``max_sequence_length`` (512, at most the tokenizer's limit), through Qwen3 with its
  attention mask; the hidden states of layers 9, 18 and 27 stacked and laid side by side per token
  ([L, 3 x hidden]: ``_get_qwen3_prompt_embeds``), with (0, 0, 0, l) text position ids (``_prepare_text_ids``).
  Qwen3 is the one, frozen, text encoder: every prompt is encoded once at start-up, then it is freed. (The script's
  ``--text_encoder_out_layers`` defaults to 10 20 30, the pipeline's to 9 18 27: we train with the layers the
  pipeline generates with);
* the latents: the VAE's ``latent_dist.mode()`` (the script does not sample), 2x2 patchified (``_patchify_latents``:
  32 channels at 1/8 -> 128 at 1/16), then normalised with the VAE's batch-norm running statistics,
  ``(z - mean) / sqrt(var + eps)``; into the transformer as one token per latent pixel (``_pack_latents``), with
  (0, row, column, 0) position ids (``_prepare_latent_ids``), and the prediction unpacked again;
* the timestep input is σ itself (the pipeline passes timestep / 1000; the transformer scales it by 1000); a
  guidance embedding gets ``--guidance_scale`` only where the transformer has one (klein has none);
* σ: the scheduler's training grid as the script indexes it (``noise_scheduler.sigmas``): klein's scheduler has
  ``use_dynamic_shifting``, so that grid is unshifted (``FamilySpec.resolution_shift``); the script's default
  weighting ``none``; LoRA's default layers are the script's (the double-stream blocks' image attention, the
  single-stream blocks' fused projections in and out).
"""

from __future__ import annotations

import torch

from xeonsd.families.flow import FlowFamily, FlowPromptConditioning, held
from xeonsd.families.flux2 import SPEC
from xeonsd.families.training import VAEView

HIDDEN_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's text_encoder_out_layers
# train_dreambooth_lora_flux2_klein.py's default --lora_layers (None): its single-block names cover klein 9B's 24
KLEIN_TARGETS = (
    "to_k",
    "to_q",
    "to_v",
    "to_out.0",
    "to_qkv_mlp_proj",
    *(f"single_transformer_blocks.{i}.attn.to_out" for i in range(24)),
)


class Flux2PromptConditioning(FlowPromptConditioning):
    """The prompt table through Qwen3: ``encode(rows)`` gives (the stacked hidden states [n, L, 3 x hidden], None:
    no pooled embedding). A row's token ids and attention mask travel together as one [2, L] tensor, so the table
    machinery of :class:`FlowPromptConditioning` (the long encoder: ``ids[-1]``; no CLIP part) serves unchanged.
    ``hidden_layers``: the encoder's layers that are stacked, ``encoder``: its name in messages (FLUX.2 [dev]'s
    subclass: Mistral3's layers 10, 20, 30)."""

    hidden_layers: tuple[int, ...] = HIDDEN_LAYERS
    encoder: str = "Qwen3"

    def _tokenize(self, texts: list[str]) -> list[torch.Tensor]:
        """[ids and mask, [n, 2, L]] of the chat-templated prompts (Flux2KleinPipeline._get_qwen3_prompt_embeds)."""
        enc = self._chat(texts, thinking=False)
        return [torch.stack([enc.input_ids, enc.attention_mask], dim=1)]

    def _t5(self, ids: torch.Tensor) -> torch.Tensor:
        """The encoder's hidden states at ``hidden_layers``, each token's side by side: [n, L, 3 x hidden]."""
        encoder = held(self.models.text_encoder, self.encoder)
        body = getattr(encoder, "model", encoder)  # the decoder without its LM head: the same hidden states
        with torch.no_grad():
            out = body(input_ids=ids[:, 0], attention_mask=ids[:, 1], output_hidden_states=True, use_cache=False)
        stacked = torch.stack([out.hidden_states[k] for k in self.hidden_layers], dim=1)
        n, layers, length, width = stacked.shape
        return stacked.permute(0, 2, 1, 3).reshape(n, length, layers * width)

    def _clip(self, ids: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return ()

    def _combine(self, clip, t5):
        return t5, None

    def _forward(self, ids: list[torch.Tensor], long: torch.Tensor | None = None) -> tuple[torch.Tensor]:
        """(the hidden states,) of freshly tokenized prompts (--shuffle_tags keeps Qwen3): no None to convert."""
        return (self._t5(ids[-1]) if long is None else long,)

    def unet_inputs(self, latents, examples) -> tuple[torch.Tensor, None]:
        """The text hidden states; nothing else (no pooled embedding)."""
        return self.for_examples(examples)[0], None

    def pipeline_kwargs(self, prompt: str) -> dict:
        """Flux2KleinPipeline's ``prompt_embeds`` (row 0, ``prompt``) and ``negative_prompt_embeds`` (row 1, the
        empty prompt: what its classifier-free guidance encodes for a base, non-distilled model)."""
        assert self.prompts.texts[0] == prompt, "the sample conditioning holds another prompt"
        hidden, _ = self.encode([0, 1])
        return {"prompt_embeds": hidden[:1], "negative_prompt_embeds": hidden[1:]}


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """[b, c, h, w] -> [b, 4c, h/2, w/2]: each 2x2 patch's pixels as channels (Flux2KleinPipeline._patchify_latents)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c * 4, h // 2, w // 2)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[b, c, h, w] -> [b, h*w, c]: one token per (patchified) latent pixel (Flux2KleinPipeline._pack_latents)."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).permute(0, 2, 1)


def latent_ids(b: int, h: int, w: int) -> torch.Tensor:
    """Each token's (0, row, column, 0), [b, h*w, 4] (Flux2KleinPipeline._prepare_latent_ids)."""
    ids = torch.zeros(h, w, 4, dtype=torch.long)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(1, h * w, 4).expand(b, -1, -1)


def reference_ids(b: int, h: int, w: int, index: int = 0) -> torch.Tensor:
    """Reference image ``index``'s (10 + 10 index, row, column, 0) position ids, [b, h*w, 4]: its latents sit a time
    step apart from the generated image's (Flux2KleinPipeline._prepare_image_ids, scale 10)."""
    ids = latent_ids(b, h, w).clone()
    ids[..., 0] = 10 + 10 * index
    return ids


def text_ids(b: int, length: int) -> torch.Tensor:
    """Each text token's (0, 0, 0, l), [b, L, 4] (Flux2KleinPipeline._prepare_text_ids)."""
    ids = torch.zeros(length, 4, dtype=torch.long)
    ids[:, 3] = torch.arange(length)
    return ids.reshape(1, length, 4).expand(b, -1, -1)


class Flux2Family(FlowFamily):
    """FLUX.2 [klein] (4B, 9B; distilled and base): one Qwen3 text encoder, a double- and single-stream
    transformer over the patchified latents."""

    spec = SPEC
    conditioning = Flux2PromptConditioning
    lora_targets = KLEIN_TARGETS

    def latent_dims(self, vae_config, vae_scale, height, width):
        return 4 * int(vae_config.latent_channels), height // (2 * vae_scale), width // (2 * vae_scale)

    def latent_vae(self, vae):
        return VAEView(vae, view=patchify, mode=True)

    def latent_affine(self, vae):
        """The batch norm's running statistics over the patchified channels: shift = mean, scaling = 1/std."""
        mean = vae.bn.running_mean.detach().float().view(-1, 1, 1)
        std = torch.sqrt(vae.bn.running_var.detach().float().view(-1, 1, 1) + vae.config.batch_norm_eps)
        return mean, 1.0 / std

    def denoiser_kwargs(self, config, noisy, sigmas, hidden, pooled, added, flow):
        """The call's arguments; with reference images (``added["references"]``: their normalised, patchified
        latents, edit training) their tokens follow the noisy ones, each image with its own position ids, as
        Flux2KleinPipeline passes ``image=``; :meth:`unpack` keeps the predictions of the noisy tokens only."""
        b, _, h, w = noisy.shape
        dtype = noisy.dtype
        guidance = torch.full((b,), flow.guidance, dtype=dtype) if config.guidance_embeds else None
        tokens, ids = pack(noisy), latent_ids(b, h, w)
        for k, reference in enumerate(added.get("references", ())):
            rh, rw = reference.shape[-2:]
            tokens = torch.cat([tokens, pack(reference.to(dtype))], dim=1)
            ids = torch.cat([ids, reference_ids(b, rh, rw, k)], dim=1)
        return {
            "hidden_states": tokens,
            "timestep": sigmas.to(dtype),
            "guidance": guidance,
            "encoder_hidden_states": hidden,
            "txt_ids": text_ids(b, hidden.shape[1]),
            "img_ids": ids,
        }

    def unpack(self, pred, shape):
        """The tokens back to [b, c, h, w] (Flux2KleinPipeline._unpack_latents_with_ids for these ids)."""
        b, c, h, w = shape
        return pred[:, : h * w].permute(0, 2, 1).reshape(b, c, h, w)


TRAINING = Flux2Family()
