"""The resolution a run trains at: ``--resolution``, or the family's own (SD 1.5 512, SD 2.1 768-v 768, SDXL, FLUX.1
and SD3 1024)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xeonsd.families import Family
    from xeonsd.trainer.config import TrainConfig


def default_resolution(family: Family | None) -> int:
    """The resolution a run trains at without --resolution: the family's, its UNet's sample size × the VAE's scale
    (SD 1.5 and SD 2 base 512, SD 2.1 768-v 768, SDXL 1024); 512 when no model was read."""
    return family.default_resolution if family is not None else 512


def with_resolution(cfg: TrainConfig, family: Family | None) -> TrainConfig:
    """``cfg`` with --resolution filled in from the family when it was not given."""
    if cfg.resolution is not None:
        return cfg
    return dataclasses.replace(cfg, resolution=default_resolution(family))
