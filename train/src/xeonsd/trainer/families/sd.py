"""SD 1.x/2.x's training side: one CLIP text encoder whose last hidden states condition the UNet, nothing per
image (the family strategy :data:`SD`)."""

from __future__ import annotations

from xeonsd.trainer.families.base import TrainFamily


class SDFamily(TrainFamily):
    name = "sd"


SD = SDFamily()
