"""Aspect-ratio buckets (``--buckets``): the bucket sizes, which bucket each image trains in, how it is resized
into it, and the order in which global batches visit them.

The bucket set (kohya's sd-scripts rule): every width from ``--min_bucket_reso`` to ``--max_bucket_reso`` in steps
of ``--bucket_reso_steps``, each with the largest height, a multiple of the step within the same bounds, whose
area stays within ``--resolution``², the transposes, and the square of ``--resolution`` (rounded down to the step).

Each image goes to the bucket nearest its aspect ratio (distance ``|log(w/h) - log(W/H)|``; ties: the larger
bucket) among those it covers, so that it is never upscaled: an image too small for its nearest bucket gets the
nearest smaller one, and one smaller than every bucket is an error naming it. It is then resized to cover the
bucket and, with ``--center_crop``, its centre cut out; without, it is resized to the bucket's size (a distortion
of at most half a step, as without buckets the whole image is resized to the square).

The batches: every pass over the data, each bucket's images are shuffled and cut into global batches (the last
one of a bucket filled up from the start of its shuffled order), and the batches are shuffled. Every draw is a
function of the seed and the pass, and a global example index maps to (pass, batch, slot): the trajectory does not
depend on the number of ranks or on a resume, only on the global batch (ranks x --train_batch_size).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from xeonsd.trainer.config import ConfigError
from xeonsd.trainer.rng import Stream, generator

log = logging.getLogger("xeonsd.train")  # the trainer's log lines keep one logger name

Size = tuple[int, int]  # (width, height) in pixels
# The bucket flags: a resumed run that changes one continues on another trajectory (a warning, as the loss options).
BUCKET_OPTIONS = ("buckets", "min_bucket_reso", "max_bucket_reso", "bucket_reso_steps")


class BucketError(ConfigError):
    """A bucket setting that cannot work, or an image that fits no bucket."""


def bucket_bounds(resolution: int, min_reso: int | None, max_reso: int | None, step: int) -> tuple[int, int]:
    """``--min_bucket_reso`` / ``--max_bucket_reso`` with their defaults (half and twice ``resolution``, rounded
    down to the step), checked: multiples of the step, and ``min <= resolution <= max``."""
    if step <= 0 or step % 8:
        raise BucketError(
            f"--bucket_reso_steps must be a positive multiple of 8 (the VAE downsamples by 8), got {step}"
        )
    lo = min_reso if min_reso is not None else max(step, resolution // 2 // step * step)
    hi = max_reso if max_reso is not None else resolution * 2 // step * step
    for name, value in (("min_bucket_reso", lo), ("max_bucket_reso", hi)):
        if value <= 0 or value % step:
            raise BucketError(f"--{name} must be a positive multiple of --bucket_reso_steps {step}, got {value}")
    if not lo <= resolution <= hi:
        raise BucketError(
            f"--min_bucket_reso {lo} <= --resolution {resolution} <= --max_bucket_reso {hi} does not hold; "
            "widen the bucket range"
        )
    return lo, hi


def bucket_sizes(resolution: int, min_reso: int, max_reso: int, step: int) -> list[Size]:
    """The bucket set, sorted by aspect ratio (width / height), narrowest first."""
    area = resolution * resolution
    side = math.isqrt(area) // step * step
    sizes = {(side, side)}
    for width in range(min_reso, max_reso + 1, step):
        height = min(max_reso, area // width // step * step)
        if height >= min_reso:
            sizes.update({(width, height), (height, width)})
    return sorted(sizes, key=lambda s: (s[0] / s[1], s[0]))


def nearest_bucket(size: Size, buckets: list[Size]) -> int | None:
    """The index of the bucket for an image of ``size``: the nearest aspect ratio among the buckets the image
    covers (ties: the larger); None when it covers none."""
    width, height = size
    ratio = math.log(width / height)
    fits = [i for i, (bw, bh) in enumerate(buckets) if bw <= width and bh <= height]
    if not fits:
        return None
    return min(
        fits, key=lambda i: (round(abs(math.log(buckets[i][0] / buckets[i][1]) - ratio), 12), -math.prod(buckets[i]))
    )


@dataclass(frozen=True)
class Placement:
    """How an image of ``size`` goes into ``bucket``: resized to ``resized``, then the bucket cut out at
    (``top``, ``left``); the mirror's left is counted from the mirrored side (``left_mirrored``)."""

    size: Size
    bucket: Size
    resized: Size
    top: int
    left: int
    left_mirrored: int


def placement(size: Size, bucket: Size, center_crop: bool) -> Placement:
    """The resize and crop of an image of ``size`` into ``bucket`` (see the module's doc)."""
    width, height = size
    bw, bh = bucket
    if not center_crop:
        return Placement(size, bucket, bucket, 0, 0, 0)
    scale = max(bw / width, bh / height)
    rw, rh = max(bw, round(width * scale)), max(bh, round(height * scale))
    top, left = (rh - bh) // 2, (rw - bw) // 2
    return Placement(size, bucket, (rw, rh), top, left, rw - bw - left)


@dataclass(frozen=True)
class Buckets:
    """The run's buckets: the sizes images were given to (``sizes``), each training image's bucket (``of_image``,
    an index into ``sizes``), and the settings that made them (for the log and train_summary.json)."""

    sizes: tuple[Size, ...]
    of_image: tuple[int, ...]
    step: int
    min_reso: int
    max_reso: int

    def counts(self) -> list[int]:
        return [self.of_image.count(b) for b in range(len(self.sizes))]

    def size_of(self, image: int) -> Size:
        return self.sizes[self.of_image[image]]

    def describe(self) -> str:
        listed = ", ".join(f"{w}x{h}: {n}" for (w, h), n in zip(self.sizes, self.counts(), strict=True))
        return f"{len(self.sizes)} bucket(s) (step {self.step}, {self.min_reso}-{self.max_reso} px): {listed}"

    def record(self) -> dict:
        """train_summary.json's ``buckets``."""
        return {
            "step": self.step,
            "min_reso": self.min_reso,
            "max_reso": self.max_reso,
            "buckets": [
                {"width": w, "height": h, "images": n} for (w, h), n in zip(self.sizes, self.counts(), strict=True)
            ],
        }


def image_size(path: Path) -> Size:
    """An image's (width, height), from its header."""
    from PIL import Image

    with Image.open(path) as im:
        return im.size


def assign(images: list[Path], resolution: int, min_reso: int | None, max_reso: int | None, step: int) -> Buckets:
    """Every image's bucket; a BucketError names the first image that fits none (and its size)."""
    lo, hi = bucket_bounds(resolution, min_reso, max_reso, step)
    candidates = bucket_sizes(resolution, lo, hi, step)
    chosen: list[int] = []
    for path in images:
        size = image_size(path)
        b = nearest_bucket(size, candidates)
        if b is None:
            smallest = min(candidates, key=math.prod)
            raise BucketError(
                f"training image {path} is {size[0]}x{size[1]}: no bucket fits inside it (images are never "
                f"upscaled; the smallest bucket is {smallest[0]}x{smallest[1]}); lower --min_bucket_reso or "
                "--resolution, or remove the image"
            )
        chosen.append(b)
    used = sorted(set(chosen))
    index = {b: k for k, b in enumerate(used)}
    return Buckets(tuple(candidates[b] for b in used), tuple(index[b] for b in chosen), step, lo, hi)


@dataclass(frozen=True)
class BucketBatches:
    """The order in which the training examples visit the images, a global batch at a time from one bucket; and
    each image's latent shape. Plugged into :class:`xeonsd.trainer.data.SamplingPlan` (``buckets``)."""

    of_image: tuple[int, ...]  # bucket index of each image
    latent_shapes: tuple[tuple[int, int, int], ...]  # per bucket: (channels, height / 8, width / 8)
    global_batch: int

    @classmethod
    def for_run(cls, buckets: Buckets | None, vae, global_batch: int, family=None) -> BucketBatches | None:
        """The batches of a run with ``buckets`` (None without; logs them), the latents of ``vae`` as the family's
        training side shapes them (``family``: a :class:`xeonsd.families.training.TrainFamily`; None: SD's)."""
        from xeonsd.families import vae_scale
        from xeonsd.families.training import TrainFamily

        if buckets is None:
            return None
        log.info("aspect-ratio buckets: %s", buckets.describe())
        family = family or TrainFamily()
        scale = vae_scale(vae.config)
        shapes = tuple(family.latent_dims(vae.config, scale, h, w) for w, h in buckets.sizes)
        return cls(buckets.of_image, shapes, global_batch)

    @property
    def pass_length(self) -> int:
        """Examples in one pass over the data: every bucket's images, rounded up to whole global batches."""
        g = self.global_batch
        return sum(-(-self.of_image.count(b) // g) * g for b in range(len(self.latent_shapes)))

    def image_for(self, seed: int, k: int) -> int:
        epoch, pos = divmod(k, self.pass_length)
        batches = _pass_order(self, seed, epoch)
        return batches[pos // self.global_batch][pos % self.global_batch]

    def latent_shape(self, image: int) -> tuple[int, int, int]:
        return self.latent_shapes[self.of_image[image]]


@functools.lru_cache(maxsize=4)
def _pass_order(batches: BucketBatches, seed: int, epoch: int) -> tuple[tuple[int, ...], ...]:
    """The global batches of one pass: each bucket's images shuffled and cut, then the batches shuffled."""
    g = batches.global_batch
    cut: list[tuple[int, ...]] = []
    for b in range(len(batches.latent_shapes)):
        members = [i for i, of in enumerate(batches.of_image) if of == b]
        perm = torch.randperm(len(members), generator=generator(seed, Stream.BUCKET_MEMBERS, epoch, b)).tolist()
        order = [members[p] for p in perm]
        full = -(-len(order) // g) * g
        order = [order[j % len(order)] for j in range(full)]
        cut += [tuple(order[j : j + g]) for j in range(0, full, g)]
    shuffled = torch.randperm(len(cut), generator=generator(seed, Stream.BUCKET_BATCHES, epoch)).tolist()
    return tuple(cut[s] for s in shuffled)
