"""SD 1.x/2.x's training side: one CLIP text encoder whose last hidden states condition the UNet, nothing per
image (the family strategy :data:`TRAINING`)."""

from __future__ import annotations

from xeonsd.families.sd import SPEC
from xeonsd.families.training import TrainFamily


class SDFamily(TrainFamily):
    spec = SPEC


TRAINING = SDFamily()
