"""SD3/SD3.5's training side (the family strategy :data:`TRAINING`), as diffusers' ``StableDiffusion3Pipeline.encode_prompt``
conditions the model and ``train_dreambooth_lora_sd3.py`` trains it:

* the text: the penultimate hidden states of CLIP-L and CLIP-G side by side (768 + 1280), zero-padded to T5's
  width (4096) and followed by T5's hidden states along the token axis (the joint ``encoder_hidden_states``);
  both CLIPs' pooled, projected outputs side by side (``pooled_projections``, 2048);
* the latents go in as they are (the transformer patches them 2x2), the timestep input is σ x
  ``num_train_timesteps``, as the scheduler's own timesteps.

diffusers' SD3 script by default also "preconditions" the output (x_σ − σ·pred against x₀): the same optimum as
the velocity target, its loss σ² times ours; we train the velocity as for FLUX.1, with the SD3 script's default
σ density (``logit_normal``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xeonsd.families.flow import FlowFamily, FlowPromptConditioning
from xeonsd.families.sd3 import SPEC


class SD3PromptConditioning(FlowPromptConditioning):
    def _clip(self, ids: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        hidden, pooled = [], []
        for one, (_, encoder) in zip(ids, self.models.text_pairs[:2], strict=True):
            out = encoder(one, output_hidden_states=True)
            pooled.append(out[0])  # text_embeds: the projected, pooled output
            hidden.append(out.hidden_states[-2])
        return torch.cat(hidden, dim=-1), torch.cat(pooled, dim=-1)

    def _combine(self, clip, t5):
        clip_hidden, pooled = clip
        clip_hidden = F.pad(clip_hidden, (0, t5.shape[-1] - clip_hidden.shape[-1]))
        return torch.cat([clip_hidden.to(t5.dtype), t5], dim=-2), pooled

    def _negative(self, hidden, pooled):
        return {"negative_prompt_embeds": hidden, "negative_pooled_prompt_embeds": pooled}


class SD3Family(FlowFamily):
    """SD3 and SD3.5 (MMDiT; SD3.5's dual-attention blocks and QK norm are the transformer's own)."""

    spec = SPEC
    conditioning = SD3PromptConditioning

    def denoiser_kwargs(self, config, noisy, sigmas, hidden, pooled, added, flow):
        return {
            "hidden_states": noisy,
            "timestep": (sigmas * flow.num_train_timesteps).to(noisy.dtype),
            "encoder_hidden_states": hidden,
            "pooled_projections": pooled,
        }


TRAINING = SD3Family()
