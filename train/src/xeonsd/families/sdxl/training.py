"""SDXL's training side (the family strategy :data:`TRAINING`). Its conditioning, as the model was trained (diffusers' ``StableDiffusionXLPipeline.encode_prompt`` and
``train_text_to_image_lora_sdxl.py`` follow the same conventions):

* the cross-attention input is the *penultimate* hidden states of both text encoders (CLIP-L, 768 wide, and
  OpenCLIP bigG, 1280 wide), concatenated along the feature axis (2048 wide);
* ``text_embeds`` is the pooled, projected output of the second encoder (``CLIPTextModelWithProjection``);
* ``time_ids`` is each image's micro-conditioning: (original height, width, crop top, crop left, target height,
  width), from the data pipeline (:func:`time_ids_for`), kept with the cached latents.

With frozen encoders each prompt's two tensors are computed once before the first step, shared out over the ranks
like the SD table (:class:`XLPromptConditioning`); a method that trains an encoder runs both every step.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from PIL import Image

from xeonsd.cluster.distributed import all_reduce_sum_
from xeonsd.families.sdxl import SPEC
from xeonsd.families.training import TrainFamily
from xeonsd.trainer.conditioning import PromptConditioning
from xeonsd.trainer.data import Example
from xeonsd.trainer.models import autocast

if TYPE_CHECKING:
    from xeonsd.trainer.buckets import Placement


def time_ids_for(image: Path, resolution: int, center_crop: bool, placement: Placement | None = None) -> torch.Tensor:
    """The micro-conditioning of an image and of its mirror, [2, 6] float32, for the way
    :func:`xeonsd.trainer.data.load_pixels` prepares them: with ``center_crop`` the centre square of the original,
    resized to ``resolution`` (the crop's top-left in the pixels of the image resized so that its shorter side is
    ``resolution``, as SDXL's training measured it; mirrored, the crop's left is counted from the mirrored side);
    without, the whole image resized to the square (no crop: 0, 0). With a bucket's ``placement``
    (:func:`xeonsd.trainer.buckets.placement`): the crop of the bucket resize, and the bucket as the target."""
    if placement is not None:
        (width, height), (bw, bh) = placement.size, placement.bucket
        rows = [
            (height, width, placement.top, placement.left, bh, bw),
            (height, width, placement.top, placement.left_mirrored, bh, bw),
        ]
        return torch.tensor(rows, dtype=torch.float32)
    with Image.open(image) as im:
        width, height = im.size
    top = left = left_mirrored = 0
    if center_crop:
        side = min(height, width)
        scale = resolution / side
        crop_top, crop_left = (height - side) // 2, (width - side) // 2
        top, left = round(crop_top * scale), round(crop_left * scale)
        left_mirrored = round((width - side - crop_left) * scale)
    rows = [
        (height, width, top, left, resolution, resolution),
        (height, width, top, left_mirrored, resolution, resolution),
    ]
    return torch.tensor(rows, dtype=torch.float32)


class XLPromptConditioning(PromptConditioning):
    """The prompt table through SDXL's two text encoders: ``encode(rows)`` gives the concatenated penultimate
    hidden states [n, 77, 768 + 1280] and the pooled ``text_embeds`` [n, 1280]; the caption draws as for SD."""

    def _tokenize(self, texts: list[str]) -> list[torch.Tensor]:
        return [
            tok(
                texts, padding="max_length", truncation=True, max_length=tok.model_max_length, return_tensors="pt"
            ).input_ids
            for tok, _ in self.models.text_pairs
        ]

    def _select(self, rows: list[int]) -> list[torch.Tensor]:
        return [ids[rows] for ids in self.ids]

    def _forward(self, ids: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, pooled = [], None
        with autocast(self.models.weight_dtype):
            for one, (_, encoder) in zip(ids, self.models.text_pairs, strict=True):
                out = encoder(one, output_hidden_states=True)
                pooled = out[0]  # the last encoder's: its projected, pooled output (text_embeds)
                hidden.append(out.hidden_states[-2])
        assert pooled is not None
        return torch.cat(hidden, dim=-1), pooled

    @torch.no_grad()
    def _encode_all(self, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.ids[0].shape[0]
        if n < world:  # fewer prompts than ranks (an instance prompt): every rank encodes them
            hidden, pooled = self._forward(self.ids)
            return hidden.float(), pooled.float()
        hidden = pooled = None
        for i in range(rank, n, world):
            h, p = self._forward(self._select([i]))
            if hidden is None:
                hidden = torch.zeros((n, *h.shape[1:]), dtype=torch.float32)
                pooled = torch.zeros((n, *p.shape[1:]), dtype=torch.float32)
            hidden[i], pooled[i] = h[0].float(), p[0].float()
        assert hidden is not None and pooled is not None
        packed = all_reduce_sum_(torch.cat([hidden.flatten(1), pooled], dim=1), world)
        split = hidden[0].numel()
        return packed[:, :split].reshape(hidden.shape).contiguous(), packed[:, split:].contiguous()

    def encode(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.table is not None:
            return self.table[0][rows], self.table[1][rows]
        return self._forward(self._select(rows))

    def unet_inputs(self, latents, examples: list[Example]) -> tuple[torch.Tensor, dict]:
        """The hidden states, and ``added_cond_kwargs``: the pooled ``text_embeds`` and each example's ``time_ids``."""
        hidden, pooled = self.for_examples(examples)
        return hidden, {"text_embeds": pooled, "time_ids": latents.time_ids_of(examples)}


class SDXLFamily(TrainFamily):
    """SDXL base: two text encoders (the second's pooled output too), micro-conditioning per image."""

    spec = SPEC
    conditioning = XLPromptConditioning

    def time_ids(self, image: Path, resolution: int, center_crop: bool, placement: Placement | None = None):
        return time_ids_for(image, resolution, center_crop, placement)


TRAINING = SDXLFamily()
