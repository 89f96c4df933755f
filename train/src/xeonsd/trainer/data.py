"""Training data: the concept's images and a rank-independent sampling plan.

Every random choice of an example (which image, flip, template, timestep or a flow model's σ, noise and its
offset, latent sample) is
a function of the seed and the example's *global* index, never of the rank that processes it (its streams:
:mod:`xeonsd.trainer.rng`). So N ranks x batch B
and one rank x batch N*B draw the same examples, and a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from xeonsd.trainer.config import TI
from xeonsd.trainer.rng import Stream, generator

if TYPE_CHECKING:
    from xeonsd.trainer.buckets import BucketBatches, Placement
    from xeonsd.trainer.flow import FlowSchedule

log = logging.getLogger(__name__)

# Caption files (see xeonsd.trainer.captions) sit beside the images; the image scan does not warn about them.
CAPTION_SUFFIXES = {".txt", ".jsonl"}
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


class DataError(ValueError):
    """The training data directory is missing, empty or holds an unreadable image."""


def find_images(data_dir: Path) -> list[Path]:
    """The image files of ``data_dir``, sorted; every one is checked to decode. Names the first bad file."""
    data_dir = Path(data_dir)
    if not data_dir.exists():
        raise DataError(f"--train_data_dir {data_dir} does not exist")
    if not data_dir.is_dir():
        raise DataError(f"--train_data_dir {data_dir} is not a directory")
    files = sorted(p for p in data_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
    skipped = [p.name for p in files if p.suffix.lower() not in IMAGE_SUFFIXES | CAPTION_SUFFIXES]
    if skipped:
        log.warning("ignoring %d non-image file(s) in %s: %s", len(skipped), data_dir, ", ".join(skipped[:5]))
    if not images:
        raise DataError(f"--train_data_dir {data_dir} holds no images (looked for {', '.join(sorted(IMAGE_SUFFIXES))})")
    for p in images:
        try:
            with Image.open(p) as im:
                im.verify()
            with Image.open(p) as im:
                im.load()
        except (OSError, UnidentifiedImageError, SyntaxError) as exc:
            raise DataError(f"cannot read training image {p}: {exc}") from exc
    return images


def place(
    im: Image.Image,
    resolution: int,
    center_crop: bool,
    placement: Placement | None = None,
    resample: Image.Resampling = Image.Resampling.BICUBIC,
) -> Image.Image:
    """The resize and crop of a training input: the ``resolution`` square (with ``center_crop``, of the centre
    square), or a bucket's ``placement`` (:func:`xeonsd.trainer.buckets.placement`). Its mask (:mod:`.masks`)
    goes through the same, with another ``resample``."""
    if placement is not None:
        (bw, bh), (top, left) = placement.bucket, (placement.top, placement.left)
        return im.resize(placement.resized, resample=resample).crop((left, top, left + bw, top + bh))
    if center_crop:
        w, h = im.size
        side = min(h, w)
        top, left = (h - side) // 2, (w - side) // 2
        im = im.crop((left, top, left + side, top + side))
    return im.resize((resolution, resolution), resample=resample)


def load_pixels(
    path: Path, resolution: int, center_crop: bool, placement: Placement | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """An image as a [3, R, R] tensor in [-1, 1], and its horizontal mirror (as the recipe prepares it); with a
    bucket's ``placement`` (:func:`xeonsd.trainer.buckets.placement`), [3, bucket height, bucket width]."""
    with Image.open(path) as im:
        pil = place(im.convert("RGB"), resolution, center_crop, placement)
    flipped = pil.transpose(Image.Transpose.FLIP_LEFT_RIGHT)

    def to_tensor(p: Image.Image) -> torch.Tensor:
        arr = np.asarray(p, dtype=np.float32) / 127.5 - 1.0
        return torch.from_numpy(arr).permute(2, 0, 1).contiguous()

    return to_tensor(pil), to_tensor(flipped)


def load_all_pixels(
    paths: list[Path], resolution: int, center_crop: bool, workers: int, placements: list[Placement] | None = None
) -> torch.Tensor | list[torch.Tensor]:
    """All distinct training inputs as [2 * len(paths), 3, R, R]: input ``2*i`` is image i, ``2*i+1`` its mirror.
    With buckets (a ``placements`` entry per image) a list of the inputs, each its bucket's size."""

    def one(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return load_pixels(paths[i], resolution, center_crop, placements[i] if placements else None)

    if workers > 0:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            pairs = list(pool.map(one, range(len(paths))))
    else:
        pairs = [one(i) for i in range(len(paths))]
    inputs = [t for pair in pairs for t in pair]
    return inputs if placements else torch.stack(inputs)


FLIP_P = 0.5  # the share of mirrored examples where a run flips (the textual-inversion recipe's flip_p)


def flips(cfg) -> bool:
    """Whether a run mirrors examples: ``--random_flip`` / ``--no-random_flip``, else its method's recipe (textual
    inversion flips, as diffusers' textual_inversion.py; LoRA and full do not, as its DreamBooth and LoRA scripts)."""
    return cfg.method == TI if cfg.random_flip is None else cfg.random_flip


@dataclass(frozen=True)
class Example:
    """All random choices for one training example."""

    index: int  # global example index
    input_id: int  # row of the pixel / latent table: 2 * image + flipped
    template: int
    timestep: int
    noise: torch.Tensor  # [4, h, w], with --noise_offset's per-channel constant added
    latent_eps: torch.Tensor  # [4, h, w], the standard-normal draw that samples the latent distribution
    sigma: float | None = None  # rectified flow (FLUX.1, SD3): the example's σ; None: a DDPM ``timestep``


@dataclass(frozen=True)
class SamplingPlan:
    seed: int
    num_images: int
    num_templates: int
    num_timesteps: int
    latent_shape: tuple[int, int, int]
    flip_p: float = FLIP_P  # 0: never mirrored (--no-random_flip)
    timestep_range: tuple[int, int] | None = None  # [lo, hi); None: [0, num_timesteps)
    noise_offset: float = 0.0
    buckets: BucketBatches | None = None  # --buckets: a global batch from one bucket, latents of its shape
    flow: FlowSchedule | None = None  # flow models: σ drawn per example from its own stream (:mod:`.flow`)

    def image_for(self, k: int) -> int:
        """Images are visited in a fresh shuffled order every pass over the data (sampling without replacement)."""
        if self.buckets is not None:
            return self.buckets.image_for(self.seed, k)
        epoch, pos = divmod(k, self.num_images)
        perm = torch.randperm(self.num_images, generator=generator(self.seed, Stream.IMAGE_ORDER, epoch))
        return int(perm[pos])

    def example(self, k: int) -> Example:
        g = generator(self.seed, Stream.EXAMPLE, k)
        image = self.image_for(k)
        shape = self.latent_shape if self.buckets is None else self.buckets.latent_shape(image)
        flip = bool(torch.rand((), generator=g) < self.flip_p)
        template = int(torch.randint(self.num_templates, (), generator=g))
        if self.timestep_range is None:
            timestep = int(torch.randint(self.num_timesteps, (), generator=g))
        else:
            timestep = int(torch.randint(*self.timestep_range, (), generator=g))
        noise = torch.randn(shape, generator=g)
        eps = torch.randn(shape, generator=g)
        if self.noise_offset:  # drawn after the others, and only when on: without it the draws are as before
            channels = shape[0]
            noise = noise + self.noise_offset * torch.randn((channels, 1, 1), generator=g)
        sigma = None
        if self.flow is not None:  # its own stream: the draws above stay as they were
            sigma = self.flow.sigma(self.flow.draw_u(generator(self.seed, Stream.FLOW_SIGMA, k)), shape)
        return Example(k, 2 * image + int(flip), template, timestep, noise, eps, sigma)

    def batch(
        self, step: int, micro: int, accumulation: int, world_size: int, rank: int, batch_size: int
    ) -> list[Example]:
        """This rank's share of optimizer step ``step``, micro-step ``micro``."""
        global_batch = world_size * batch_size
        first = (step * accumulation + micro) * global_batch + rank * batch_size
        return [self.example(first + i) for i in range(batch_size)]
