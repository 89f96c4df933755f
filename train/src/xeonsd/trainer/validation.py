"""The validation loss: images held out of training (``--validation_split F`` or ``--validation_data_dir DIR``)
and, every ``--validation_steps``, the denoising loss on them at fixed timesteps with fixed noise.

* Which images: ``--validation_split`` takes ``max(1, round(F x n))`` of the n images, the first in the order of
  a hash of their file names: the same images in every run, whatever the seed, the world size or a resume; a
  split that leaves no training image is refused. ``--validation_data_dir`` takes every image of that directory
  (and its captions, when the run trains on captions).
* What is measured: each held-out image (never mirrored) at :data:`TIMESTEPS` timesteps spread evenly over the
  trained range (a flow model: at the σ of the middles of as many equal bands of u, through its schedule), with noise and the latent's sample drawn from (seed, image, timestep) only, so every evaluation
  sees exactly the same inputs and the curve moves only with the weights. The prompt is the image's caption with
  ``--caption_prefix`` and nothing drawn (no dropout, no shuffle), or the training prompt (an instance prompt; the
  templates taken in turn). The loss is the training loss's (min-SNR weights included), without gradient.
* Every rank evaluates its share of the examples; one all-reduce sums them, so the figure is the same on any world
  size (up to the order of the float additions).

The validation *images* (``--validation_prompt``, rendered by :func:`xeonsd.trainer.pipelines.render_validation` every
``--validation_steps`` and at the end) become one picture at the end, :func:`write_image_grid`: a row per image,
a column per evaluation.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from xeonsd.cluster.distributed import all_reduce_sum_
from xeonsd.fsutil import atomic_path
from xeonsd.trainer import sharding
from xeonsd.trainer.captions import CaptionDraws, Captions, read_captions
from xeonsd.trainer.config import ConfigError, TrainConfig
from xeonsd.trainer.data import DataError, Example, find_images
from xeonsd.trainer.methods import method_class
from xeonsd.trainer.metrics import GRID
from xeonsd.trainer.rng import Stream, generator
from xeonsd.trainer.step import LossInputs, step_loss

if TYPE_CHECKING:
    from xeonsd.trainer.conditioning import PromptConditioning
    from xeonsd.trainer.latents import LatentTable
    from xeonsd.trainer.prompt_tables import PromptTable

TIMESTEPS = 4  # evaluated timesteps per held-out image


@dataclass(frozen=True)
class HeldOut:
    """The images the validation loss is measured on, their captions, and where they came from."""

    images: list[Path]
    captions: Captions | None
    source: str  # "--validation_split 0.2" or "--validation_data_dir DIR"


def _subset(captions: Captions | None, keep: list[int]) -> Captions | None:
    if captions is None:
        return None
    return Captions(tuple(captions.texts[i] for i in keep), captions.source, tuple(captions.where[i] for i in keep))


def hold_out(
    cfg: TrainConfig, images: list[Path], captions: Captions | None
) -> tuple[list[Path], Captions | None, HeldOut | None]:
    """(training images, their captions, the held-out set or None) for the run's validation flags."""
    if cfg.validation_split and cfg.validation_data_dir:
        raise ConfigError("--validation_split and --validation_data_dir both choose the held-out images: give one")
    if cfg.validation_data_dir:
        data = Path(cfg.validation_data_dir)
        try:
            held = find_images(data)
        except DataError as exc:
            raise DataError(str(exc).replace("--train_data_dir", "--validation_data_dir")) from exc
        source = f"--validation_data_dir {data}"
        return images, captions, HeldOut(held, read_captions(data, held, cfg.caption_column), source)
    if not cfg.validation_split:
        return images, captions, None
    if not 0 < cfg.validation_split < 1:
        raise ConfigError(f"--validation_split is a fraction in (0, 1) (0: off), got {cfg.validation_split}")
    n = len(images)
    count = max(1, round(cfg.validation_split * n))
    if count >= n:
        raise ConfigError(
            f"--validation_split {cfg.validation_split} holds out {count} of the {n} image(s) of "
            f"{cfg.train_data_dir}, which leaves no training image; use a smaller split, more images, or "
            "--validation_data_dir"
        )
    order = sorted(range(n), key=lambda i: hashlib.sha256(images[i].name.encode()).hexdigest())
    held = sorted(order[:count])
    kept = [i for i in range(n) if i not in set(held)]
    source = f"--validation_split {cfg.validation_split}"
    return (
        [images[i] for i in kept],
        _subset(captions, kept),
        HeldOut([images[i] for i in held], _subset(captions, held), source),
    )


def check_held_out(cfg: TrainConfig, held: HeldOut, uses_captions: bool) -> None:
    """The held-out images need what the training images have: captions when the run trains on captions, and for
    textual inversion the placeholder in each; and the evaluation needs --validation_steps."""
    if cfg.validation_steps < 1:
        raise ConfigError(f"--validation_steps must be at least 1 with {held.source}, got {cfg.validation_steps}")
    if not uses_captions:
        return
    if held.captions is None:
        raise DataError(
            f"{held.source}: its images have no captions, but this run trains on captions; give them captions "
            "(metadata.jsonl, a .txt beside each image, or captions.txt) or train with --captions off"
        )
    method_class(cfg.method).check_captions(cfg, held.captions, "")


@dataclass(frozen=True)
class ValidationSet:
    """The held-out images' prompts, their text conditioning and latents, and the fixed examples."""

    held: HeldOut
    prompts: PromptTable
    text: PromptConditioning  # the family's (its FamilySpec.training)
    latents: LatentTable
    timesteps: tuple[int, ...]
    seed: int
    sigmas: tuple[float, ...] | None = None  # flow models: the fixed σ of each of the TIMESTEPS evaluations

    @property
    def size(self) -> int:
        return len(self.held.images) * len(self.timesteps)

    def example(self, k: int) -> Example:
        """Example ``k``: image ``k // TIMESTEPS`` (not mirrored) at its ``k % TIMESTEPS``-th timestep."""
        image, j = divmod(k, len(self.timesteps))
        g = generator(self.seed, Stream.VALIDATION, k)
        noise = torch.randn(self.latents.shape, generator=g)
        eps = torch.randn(self.latents.shape, generator=g)
        sigma = self.sigmas[j] if self.sigmas is not None else None
        return Example(k, 2 * image, image % self.prompts.num_templates, self.timesteps[j], noise, eps, sigma)


def fixed_timesteps(lo: int, hi: int, count: int = TIMESTEPS) -> tuple[int, ...]:
    """``count`` timesteps spread evenly over [lo, hi): the middles of ``count`` equal bands."""
    return tuple(lo + (hi - lo) * (2 * j + 1) // (2 * count) for j in range(count))


def validation_text(
    cfg: TrainConfig, info, models, method, held: HeldOut | None, references: dict | None = None
) -> tuple | None:
    """(the held-out captions' prompt table, its conditioning), built with the training prompts: before the VAE
    encodes, while a flow family's T5 is still loaded. ``references``: every image's reference images (edit
    training), which a family whose text encoder reads them gets in the table."""
    if held is None:
        return None

    prompts = method.prompts(held.captions)
    if references:
        prompts = models.training.with_references(prompts, [references[p] for p in held.images])
    draws = CaptionDraws(prefix=(cfg.caption_prefix or "").strip())  # the prefix; nothing drawn
    text = models.training.conditioning(models, prompts, method.trains_text_encoder, info.rank, info.world_size, draws)
    return prompts, text


def build_validation(
    cfg: TrainConfig,
    info,
    models,
    held: HeldOut | None,
    text: tuple | None,
    seed: int,
    timestep_range: tuple[int, int],
    references: dict[Path, tuple[Path, ...]] | None = None,
) -> ValidationSet | None:
    """The validation set, on every rank (its latent table is shared out like the training one); ``text``: its
    :func:`validation_text`; ``references``: the held-out images' reference images (edit training)."""
    if held is None or text is None:
        return None
    from xeonsd.trainer.latents import LatentTable

    prompts, text = text
    latents = LatentTable.build(
        cfg, models, held.images, info.rank, info.local_rank, info.world_size, references=references, mirrors=False
    )
    sigmas = None
    if models.flow is not None:  # the middles of TIMESTEPS equal bands of u, through the model's own σ schedule
        sigmas = tuple(models.flow.sigma((2 * j + 1) / (2 * TIMESTEPS), latents.shape) for j in range(TIMESTEPS))
    return ValidationSet(held, prompts, text, latents, fixed_timesteps(*timestep_range), seed, sigmas)


@torch.no_grad()
def validation_loss(vs: ValidationSet, training: LossInputs, rank: int, world: int, batch: int) -> float:
    """The mean loss over the validation examples: this rank's share in batches of ``batch``, summed over the
    ranks in one all-reduce. Every rank calls it. ``training``: the training step's inputs, whose models score the
    held-out prompts and latents; their own UNet, not the DistributedDataParallel wrapper the steps may call
    (nothing to synchronise here). A sharded UNet's (--fsdp) every call is collective: every rank makes as many as
    the rank with the largest share (a rank out of examples scores example 0 again and counts nothing)."""
    held = dataclasses.replace(training, unet=training.models.unet, text=vs.text, latents=vs.latents, prior=None)
    mine = list(range(rank, vs.size, world))
    sharded = sharding.is_sharded(training.models.unet)
    calls = -(-len(range(0, vs.size, world)) // batch) if sharded else -(-len(mine) // batch)
    total = torch.zeros(1, dtype=torch.float64)
    for call in range(calls):
        first = call * batch
        examples = [vs.example(k) for k in mine[first : first + batch]]
        if not examples:  # sharded: a call for the others' sake
            step_loss(held, [vs.example(0)])
            continue
        total += float(step_loss(held, examples)) * len(examples)
    return float(all_reduce_sum_(total, world)[0]) / vs.size


def _step_dirs(validation_dir: Path) -> list[tuple[str, Path]]:
    """(column label, directory) of ``validation/step-N`` in step order, then ``validation/final``."""
    steps = sorted((int(d.name[5:]), d) for d in validation_dir.glob("step-*") if d.is_dir() and d.name[5:].isdigit())
    columns = [(f"step {n}", d) for n, d in steps]
    if (validation_dir / "final").is_dir():
        columns.append(("final", validation_dir / "final"))
    return columns


def write_image_grid(out_dir: Path, cell: int = 128) -> Path | None:
    """``validation_grid.png``: the validation prompt's images over the run, one row per image (seed), one column
    per ``--validation_steps`` evaluation and the final one, each labelled; None when there are none."""
    from PIL import Image, ImageDraw

    columns = [(label, sorted(d.glob("*.png"))) for label, d in _step_dirs(Path(out_dir) / "validation")]
    columns = [(label, files) for label, files in columns if files]
    if not columns:
        return None
    rows = max(len(files) for _, files in columns)
    head = 16
    grid = Image.new("RGB", (cell * len(columns), head + cell * rows), "white")
    draw = ImageDraw.Draw(grid)
    for c, (label, files) in enumerate(columns):
        draw.text((c * cell + 4, 2), label, fill="black")
        for r, path in enumerate(files):
            with Image.open(path) as im:
                grid.paste(im.convert("RGB").resize((cell, cell)), (c * cell, head + r * cell))
    path = Path(out_dir) / GRID
    with atomic_path(path) as tmp:
        grid.save(tmp, format="png")
    return path
