"""Every random draw of a run, by stream: one registry, so no two draws share a generator.

A draw's generator is seeded from the run's seed, its :class:`Stream` and its keys (an example's global index, an
epoch, a bucket), never from the rank or the world size: N ranks x batch B and one rank x batch N*B draw the same
examples, and a resumed run continues exactly where it stopped. :func:`generator` takes a :class:`Stream` member
only (a bare number is refused), and ``tests/xeonsd/trainer/test_rng.py`` checks that each member has one user.
"""

from __future__ import annotations

import enum

import torch


@enum.unique
class Stream(enum.IntEnum):
    """The streams of the run's seed. The numbers are part of every trajectory: never renumber one."""

    IMAGE_ORDER = 1  # the shuffled image order of each epoch (keyed by epoch)
    EXAMPLE = 2  # an example's flip, template, timestep, noise and latent sample (keyed by global index)
    METHOD_INIT = 3  # a method's new weights (LoRA's), the same on every rank
    BUCKET_MEMBERS = 4  # the order of a bucket's images in an epoch (keyed by epoch, bucket)
    BUCKET_BATCHES = 5  # the order of an epoch's bucket batches (keyed by epoch)
    VALIDATION = 6  # a held-out example's noise and latent sample (keyed by index)
    CAPTIONS = 7  # an example's caption dropout and tag order (keyed by global index; until 2026-12 it shared 5)
    PRIOR_PLAN = 11  # the class images' own sampling plan
    FLOW_SIGMA = 12  # a flow model's σ of an example (keyed by global index; --weighting_scheme's density)


# The class images of prior preservation are rendered from seeds of their own, the same in every run and on every
# rank (image i: ``mix(CLASS_IMAGE_SEED, i)``): a cache of them serves every run.
CLASS_IMAGE_SEED = 0xC1A55


def mix(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64-style), so nearby indices give unrelated streams."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


def stream_seed(seed: int, stream: Stream, *keys: int) -> int:
    """The seed of one draw: the run's ``seed``, its ``stream`` and its keys."""
    if not isinstance(stream, Stream):
        raise TypeError(f"a random stream must be a trainer.rng.Stream member, got {stream!r}")
    return mix(seed, int(stream), *keys)


def generator(seed: int, stream: Stream, *keys: int) -> torch.Generator:
    """A CPU generator for one draw of ``stream`` (see :func:`stream_seed`)."""
    g = torch.Generator()
    g.manual_seed(stream_seed(seed, stream, *keys))
    return g
