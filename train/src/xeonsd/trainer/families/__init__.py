"""The training side of each model family, one module each, registered in :data:`FAMILIES` by the name its
:class:`xeonsd.modelfiles.families.FamilySpec` has. docs/trainer.md ("Adding a family") says what a new one needs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from xeonsd.modelfiles.families import FamilyError, family_spec
from xeonsd.trainer.families.base import TrainFamily
from xeonsd.trainer.families.flux import FLUX
from xeonsd.trainer.families.flux2 import FLUX2
from xeonsd.trainer.families.qwenimage import QWENIMAGE
from xeonsd.trainer.families.sd import SD
from xeonsd.trainer.families.sd3 import SD3
from xeonsd.trainer.families.sdxl import SDXL
from xeonsd.trainer.families.zimage import ZIMAGE

if TYPE_CHECKING:
    from xeonsd.modelfiles.families import Family

FAMILIES: dict[str, TrainFamily] = {family.name: family for family in (SD, SDXL, FLUX, SD3, FLUX2, ZIMAGE, QWENIMAGE)}


def train_family(family: Family | None) -> TrainFamily:
    """The training side of ``family`` (None: models built by hand, SD 1.x/2.x); FamilyError for a family that is
    detected but has no training side."""
    name = family_spec(family).name
    if name not in FAMILIES:
        raise FamilyError(f"training {family_spec(family).label} is not supported; trainable: {', '.join(FAMILIES)}")
    return FAMILIES[name]


__all__ = ["FAMILIES", "TrainFamily", "train_family"]
