"""Masked loss (``--masks DIR``): one grey-scale mask per training image, of its file stem (``DIR/p0.png`` for
``p0.jpg``) and its size; white counts, black does not, grey weighs in between.

A mask goes through its image's resize and crop (:func:`xeonsd.trainer.data.place`: the square, the centre crop,
a bucket's placement), area-resampled, then each latent pixel gets the mean of the mask over the pixels it covers
(the VAE's downscale; FLUX.2 [klein]'s 2x2-patchified latents cover twice as many: ``TrainFamily.latent_dims``
says how many), and the mirrored input (row ``2*i+1`` of the latent table) gets it mirrored. The masks are made at
start-up from the files (cheap: no VAE), kept beside the latents (``LatentTable.mask``), never in the disk cache.
The loss weighs each squared error by its latent pixel's mask and normalises each example by its mask's sum
(:func:`xeonsd.trainer.loss.mask_weights`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, UnidentifiedImageError

from xeonsd.trainer.data import IMAGE_SUFFIXES, DataError, place

if TYPE_CHECKING:
    from xeonsd.trainer.buckets import Placement


def read_mask(path: Path) -> Image.Image:
    """A mask file as a float image ("F") in [0, 1]: its grey levels over 255."""
    with Image.open(path) as im:
        grey = np.asarray(im.convert("L"), dtype=np.float32) / 255.0
    return Image.fromarray(grey)  # float32: mode "F"


def find_masks(
    mask_dir: Path,
    images: list[Path],
    resolution: int,
    center_crop: bool,
    placements: list[Placement] | None = None,
) -> dict[Path, Path]:
    """Each training image's mask in ``mask_dir`` (same stem, an image suffix), every one checked: it decodes, it
    has its image's size and some of it is not black where the image is cropped to (at ``resolution``, or in
    its bucket's ``placements[i]``). A DataError names the first file that fails."""
    mask_dir = Path(mask_dir)
    if not mask_dir.is_dir():
        raise DataError(f"--masks {mask_dir} is not a directory")
    by_stem: dict[str, list[Path]] = {}
    for p in sorted(mask_dir.iterdir()):
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_SUFFIXES:
            by_stem.setdefault(p.stem, []).append(p)
    found: dict[Path, Path] = {}
    for k, image in enumerate(images):
        candidates = by_stem.get(image.stem, [])
        if not candidates:
            raise DataError(f"--masks: no mask for training image {image}: expected {mask_dir / image.stem}.png")
        if len(candidates) > 1:
            names = ", ".join(str(p) for p in candidates)
            raise DataError(f"--masks: {names}: several masks for training image {image}; keep one")
        mask = candidates[0]
        try:
            grey = read_mask(mask)
        except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:
            raise DataError(f"--masks: cannot read mask {mask}: {exc}") from exc
        with Image.open(image) as im:
            size = im.size
        if grey.size != size:
            raise DataError(
                f"--masks: mask {mask} is {grey.size[0]}x{grey.size[1]}, its image {image} {size[0]}x{size[1]}; "
                "a mask has its image's size"
            )
        placed = place(grey, resolution, center_crop, placements[k] if placements else None, Image.Resampling.BOX)
        if not np.asarray(placed).any():
            raise DataError(f"--masks: mask {mask} is black where its image is trained: nothing of it would count")
        found[image] = mask
    return found


def latent_mask(
    path: Path, resolution: int, center_crop: bool, placement: Placement | None, dims: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mask of ``path`` at latent resolution ``dims`` (height, width), for the image and for its mirror:
    [1, h, w] each, in [0, 1]. The image's resize and crop with an area filter, then each latent pixel the mean of
    the pixels it covers."""
    placed = np.asarray(place(read_mask(path), resolution, center_crop, placement, Image.Resampling.BOX))
    pixels = torch.from_numpy(placed.copy()).clamp(0.0, 1.0)[None, None]
    mask = F.adaptive_avg_pool2d(pixels, dims)[0]
    return mask, torch.flip(mask, dims=(-1,))


def mask_rows(
    masks: list[Path],
    resolution: int,
    center_crop: bool,
    placements: list[Placement] | None,
    shapes: list[tuple[int, int, int]],
) -> torch.Tensor | list[torch.Tensor]:
    """The masks of the latent table's rows (row ``2*i`` image i's mask, ``2*i+1`` mirrored), each [1, h, w] of
    that row's latent ``shapes[row]`` (c, h, w): one tensor [rows, 1, h, w] where every row has one shape, else a
    list (aspect-ratio buckets of several sizes)."""
    rows: list[torch.Tensor] = []
    for k, path in enumerate(masks):
        rows += latent_mask(path, resolution, center_crop, placements[k] if placements else None, shapes[2 * k][1:])
    return torch.stack(rows) if len(set(shapes)) == 1 else rows
