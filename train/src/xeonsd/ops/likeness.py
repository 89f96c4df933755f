"""How close generated pictures are to a concept's training images: the number under the report's before and after
rows, and the one the learning proofs hold.

Each picture and each training image is reduced to SIDE x SIDE pixels (the layout of colours, not the fine detail
a small model cannot draw), and a picture's distance is the RMS difference, in [0, 1] of the colour range, to the
training image nearest it; a row's distance is the mean over its pictures. 0: a picture repeats a training image;
two pictures of unrelated flat colours are some 0.3-0.5 apart."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
from PIL import Image

SIDE = 16
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


def small(image: Image.Image, side: int = SIDE) -> np.ndarray:
    """``image`` as side x side x 3 floats in [0, 1] (box-filtered: each pixel the mean colour of its area)."""
    return np.asarray(image.convert("RGB").resize((side, side), Image.BOX), np.float32) / 255


def training_images(data_dir: Path) -> list[Image.Image]:
    """The images of a training directory, in name order."""
    files = sorted(p for p in Path(data_dir).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    return [Image.open(p).convert("RGB") for p in files]


def distances(pictures: Iterable[Image.Image], references: Iterable[Image.Image]) -> list[float]:
    """Each picture's RMS distance to the reference nearest it."""
    refs = np.stack([small(r) for r in references])
    return [float(np.sqrt(((refs - small(p)) ** 2).mean(axis=(1, 2, 3))).min()) for p in pictures]


def distance(pictures: Iterable[Image.Image], references: Iterable[Image.Image]) -> float:
    """The mean of :func:`distances`: how far a row of pictures is from the training images."""
    return float(np.mean(distances(pictures, references)))
