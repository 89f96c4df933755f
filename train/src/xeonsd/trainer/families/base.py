"""What a model family's training side is: the strategy each family module defines one instance of."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from xeonsd.trainer.conditioning import PromptConditioning

if TYPE_CHECKING:
    from xeonsd.trainer.buckets import Placement


class TrainFamily:
    """A family's training side (its files, classes and export names: :class:`xeonsd.modelfiles.families.FamilySpec`
    of the same ``name``): how its prompts condition the model (``conditioning``: the prompt table through its
    text encoders, and what the UNet call takes besides the latents), and what each training image adds
    (``time_ids``). The memory estimate reads the text encoders from the spec."""

    name: ClassVar[str]
    conditioning: ClassVar[type[PromptConditioning]] = PromptConditioning

    def time_ids(
        self, image: Path, resolution: int, center_crop: bool, placement: Placement | None = None
    ) -> torch.Tensor | None:
        """The micro-conditioning of an image and of its mirror ([2, n]), kept with the cached latents; None: the
        family has none."""
        return None
