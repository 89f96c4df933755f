"""FLUX.1's training side (the family strategy :data:`TRAINING`), as diffusers' ``FluxPipeline`` runs the model and
``train_dreambooth_lora_flux.py`` trains it:

* the text: CLIP-L's pooled output (``pooled_projections``) and T5's hidden states (``encoder_hidden_states``,
  the pipeline's ``max_sequence_length`` tokens), with all-zero text position ids (``txt_ids``);
* the latents packed 2x2 into tokens (16 channels -> 64 per token), with their (0, row, column) position ids
  (``img_ids``), and the prediction unpacked again;
* the timestep input is σ itself (the transformer scales it by 1000), and FLUX.1-dev's guidance embedding gets
  ``--guidance_scale`` (3.5, diffusers' default); schnell has none.
"""

from __future__ import annotations

import torch

from xeonsd.families.flow import FlowFamily, FlowPromptConditioning, pack, unpack
from xeonsd.families.flux import SPEC


class FluxPromptConditioning(FlowPromptConditioning):
    def _clip(self, ids: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return (self.models.text_encoder(ids[0], output_hidden_states=False).pooler_output,)

    def _combine(self, clip, t5):
        return t5, clip[0]


def image_ids(h: int, w: int, dtype: torch.dtype) -> torch.Tensor:
    """Each token's (0, row, column) for a latent of h x w (FluxPipeline._prepare_latent_image_ids)."""
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] = torch.arange(h // 2)[:, None]
    ids[..., 2] = torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3).to(dtype)


class FluxFamily(FlowFamily):
    """FLUX.1 dev (guidance embedding) and schnell."""

    spec = SPEC
    conditioning = FluxPromptConditioning

    def denoiser_kwargs(self, config, noisy, sigmas, hidden, pooled, added, flow):
        b, _, h, w = noisy.shape
        dtype = noisy.dtype
        guidance = torch.full((b,), flow.guidance, dtype=dtype) if config.guidance_embeds else None
        return {
            "hidden_states": pack(noisy),
            "timestep": sigmas.to(dtype),
            "guidance": guidance,
            "pooled_projections": pooled,
            "encoder_hidden_states": hidden,
            "txt_ids": torch.zeros(hidden.shape[1], 3, dtype=dtype),
            "img_ids": image_ids(h, w, dtype),
        }

    def unpack(self, pred, shape):
        return unpack(pred, shape[-2], shape[-1])


TRAINING = FluxFamily()
