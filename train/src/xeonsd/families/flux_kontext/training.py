"""FLUX.1 Kontext's training side (the family strategy :data:`TRAINING`): FLUX.1's (:mod:`xeonsd.families.flux`),
with a reference image as ``FluxKontextPipeline`` passes ``image=`` and diffusers'
``train_dreambooth_lora_flux_kontext.py`` trains it: the reference's latents, packed 2x2 like the noisy ones, follow
them in the call, with the same (row, column) position ids and 1 in the first coordinate (the generated image's
is 0); the prediction of the noisy tokens alone is kept."""

from __future__ import annotations

import torch

from xeonsd.families.flow import pack, unpack
from xeonsd.families.flux.training import FluxFamily, image_ids
from xeonsd.families.flux_kontext import SPEC


def reference_ids(h: int, w: int, dtype: torch.dtype) -> torch.Tensor:
    """A reference latent's (1, row, column) per token (FluxKontextPipeline.prepare_latents' ``image_ids``)."""
    ids = image_ids(h, w, dtype)
    ids[:, 0] = 1
    return ids


class FluxKontextFamily(FluxFamily):
    """FLUX.1 Kontext [dev]: FLUX.1's objective and text side, with a reference image's tokens."""

    spec = SPEC

    def denoiser_kwargs(self, config, noisy, sigmas, hidden, pooled, added, flow):
        kwargs = super().denoiser_kwargs(config, noisy, sigmas, hidden, pooled, added, flow)
        for reference in added.get("references", ()):  # one: FluxKontextPipeline takes one image
            rh, rw = reference.shape[-2:]
            kwargs["hidden_states"] = torch.cat([kwargs["hidden_states"], pack(reference.to(noisy.dtype))], dim=1)
            kwargs["img_ids"] = torch.cat([kwargs["img_ids"], reference_ids(rh, rw, noisy.dtype)], dim=0)
        return kwargs

    def unpack(self, pred, shape):
        h, w = shape[-2], shape[-1]
        return unpack(pred[:, : (h // 2) * (w // 2)], h, w)


TRAINING = FluxKontextFamily()
