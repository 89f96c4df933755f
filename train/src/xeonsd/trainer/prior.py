"""DreamBooth prior preservation (``--with_prior_preservation``, LoRA and full fine-tuning).

Besides the instance images, each step trains on as many *class* images (``--class_prompt``, e.g. "a photo of a
dog") so the model keeps what the class looked like before: loss = instance loss + ``--prior_loss_weight`` × class
loss. The class images live in ``--class_data_dir``: the images already there are used (sorted by name, the first
``--num_class_images``), the missing ones are generated from the base model before training and kept for the next
run. Generation is spread over the ranks by index (image ``i``'s seed is a function of ``i`` only, so the same image
comes out whichever rank draws it, up to float rounding); one all-reduce gives every rank all of them, and one rank
per node writes each of them, atomically (an image some node lacked is rewritten on the others too, so every node
trains on the same bytes). The class prompt is encoded once with the frozen text encoder (every step when
the method trains the text encoder, as the instance prompts); each
instance example ``k`` is paired with class example ``k`` of a second sampling plan, so the pairing is a function
of (seed, global index) like everything else.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from xeonsd.cluster.distributed import all_reduce_sum_, barrier, collective
from xeonsd.cluster.launch import RankInfo
from xeonsd.contracts.method_names import PRIOR_NEEDS_WEIGHTS
from xeonsd.fsutil import atomic_path
from xeonsd.trainer.config import ConfigError, TrainConfig
from xeonsd.trainer.data import IMAGE_SUFFIXES, Example, SamplingPlan
from xeonsd.trainer.methods import method_class
from xeonsd.trainer.prompt_tables import PromptTable
from xeonsd.trainer.rng import CLASS_IMAGE_SEED, Stream, mix, stream_seed

log = logging.getLogger("xeonsd.train")

GENERATED = re.compile(r"class-\d{5}\.png")  # the names of generated class images
CLASS_STEPS = 25  # denoising steps per generated class image (as the validation images)
GENERATE_CHUNK = 8  # class images per all-reduce while they are generated


def check_prior_flags(cfg: TrainConfig) -> None:
    """The prior-preservation flags on their own, and the class data dir: it must be writable when images are
    missing. Called before any model loads."""
    if not cfg.with_prior_preservation:
        given = [f for f in ("class_prompt", "class_data_dir", "class_export") if getattr(cfg, f)]
        if given:
            verb = "needs" if len(given) == 1 else "need"
            raise ConfigError(" and ".join(f"--{f}" for f in given) + f" {verb} --with_prior_preservation")
        return
    if not method_class(cfg.method).trains_unet:  # textual inversion: every weight stays as it was
        raise ConfigError(PRIOR_NEEDS_WEIGHTS)
    for name in ("class_prompt", "class_data_dir"):
        if not getattr(cfg, name):
            raise ConfigError(f"--with_prior_preservation needs --{name}")
    if cfg.num_class_images < 1:
        raise ConfigError(f"--num_class_images must be at least 1, got {cfg.num_class_images}")
    if not cfg.prior_loss_weight > 0:
        raise ConfigError(f"--prior_loss_weight must be positive, got {cfg.prior_loss_weight}")
    class_dir = Path(cfg.class_data_dir).expanduser()
    if len(_existing(class_dir)) >= cfg.num_class_images:
        return
    try:
        class_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--class_data_dir {class_dir} cannot be created for the class images: {exc}") from exc
    if not os.access(class_dir, os.W_OK | os.X_OK):
        raise ConfigError(
            f"--class_data_dir {class_dir} is not writable, and it lacks class images "
            f"({len(_existing(class_dir))} of --num_class_images {cfg.num_class_images}): make it writable or "
            "put the images there"
        )


def _existing(class_dir: Path) -> list[Path]:
    if not class_dir.is_dir():
        return []
    return sorted(p for p in class_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith("."))


def class_image_names(class_dir: Path, count: int) -> list[str]:
    """The class images of a run: the first ``count`` images already in ``class_dir`` (sorted by name), then
    ``class-NNNNN.png`` for the missing ones (numbered from the first free number)."""
    names = [p.name for p in _existing(class_dir)][:count]
    taken, i = set(names), 0
    while len(names) < count:
        name = f"class-{i:05d}.png"
        if name not in taken:
            names.append(name)
        i += 1
    return names


# --class_export's opener, handed in by the CLI (the trainer may not import xeonsd.openvino):
# (export or directory of exports, base model fingerprint, resolution, steps) -> ((prompt, seed) -> PIL image,
# the export used), or None where no export of this base model is there.
ClassRendererOpener = Callable[[Path, str, int, int], "tuple[Callable[[str, int], Any], Path] | None"]


def ensure_class_images(
    cfg: TrainConfig, models, info: RankInfo, open_renderer: ClassRendererOpener | None = None
) -> list[Path]:
    """The run's class images in ``--class_data_dir`` on every rank: the missing ones generated from the base
    model (before the method changes it), shared out over the ranks, written by one rank per node. With
    ``--class_export``, the ranks whose node holds an OpenVINO export of the base model render them all through it;
    where no node does, every rank renders its share with PyTorch."""
    class_dir = Path(cfg.class_data_dir).expanduser()
    names = class_image_names(class_dir, cfg.num_class_images)
    if info.world_size > 1:  # rank 0's listing decides the names
        box = [names]
        with collective("broadcast of the class image names"):
            torch.distributed.broadcast_object_list(box, src=0)
        names = box[0]
    paths = [class_dir / n for n in names]
    have = torch.tensor([int(p.is_file()) for p in paths], dtype=torch.int64)
    everywhere = all_reduce_sum_(have.clone(), info.world_size)
    todo = [i for i in range(len(paths)) if everywhere[i] < info.world_size]
    staged = [names[i] for i in todo if not GENERATED.fullmatch(names[i])]
    if staged:  # a user's own image cannot be made again: it must be on every node
        raise ConfigError(
            f"--class_data_dir {class_dir} holds {', '.join(staged[:5])} on rank 0's node but not on every node: "
            "copy the class images to every node, or remove them there and let the trainer generate them"
        )
    if todo:
        render, renderers = _renderer(cfg, info, open_renderer)  # renderers: the ranks with an export
        log.info(
            "generating %d of %d class image(s) for %r into %s (%s)",
            len(todo),
            len(paths),
            cfg.class_prompt,
            class_dir,
            f"OpenVINO on {len(renderers)} rank(s)" if renderers else "PyTorch",
        )
        pipe = None
        if not renderers:  # no node holds an export: every rank renders its share with PyTorch
            from xeonsd.trainer.pipelines import inference_pipeline

            pipe, renderers = inference_pipeline(models), list(range(info.world_size))
        for k in range(0, len(todo), GENERATE_CHUNK):
            chunk = todo[k : k + GENERATE_CHUNK]
            pixels = torch.zeros((len(chunk), cfg.resolution, cfg.resolution, 3), dtype=torch.float32)
            for j in range(len(chunk)):
                if renderers[j % len(renderers)] != info.rank:
                    continue
                if pipe is not None:
                    pixels[j] = _generate(pipe, cfg, models, chunk[j])
                else:
                    pixels[j] = _pixels(render(cfg.class_prompt, mix(CLASS_IMAGE_SEED, chunk[j])))
            all_reduce_sum_(pixels, info.world_size)
            if info.local_rank == 0:  # also where a node had it: every node then trains on the same bytes
                for j, i in enumerate(chunk):
                    with atomic_path(paths[i]) as tmp:
                        Image.fromarray(pixels[j].round().clamp(0, 255).to(torch.uint8).numpy()).save(tmp, "PNG")
        barrier(info.world_size)  # the node's writer is done before any rank reads the files
    log.info("class images: %d reused, %d generated", len(paths) - len(todo), len(todo))
    return paths


def _renderer(cfg: TrainConfig, info: RankInfo, open_renderer: ClassRendererOpener | None):
    """(this rank's OpenVINO renderer or None, the ranks that have one): None, [] when no rank has one."""
    from xeonsd.modelfiles.modelsource import model_fingerprint

    render = None
    if cfg.class_export and open_renderer is not None:
        fingerprint = model_fingerprint(cfg.pretrained_model_name_or_path, cfg.revision)
        opened = open_renderer(Path(cfg.class_export), fingerprint, cfg.resolution, CLASS_STEPS)
        if opened is not None:
            render = opened[0]
            log.info("class images: this rank renders through the OpenVINO export %s", opened[1])
    flags = torch.zeros(info.world_size, dtype=torch.int64)
    flags[info.rank] = int(render is not None)
    holders = [r for r, f in enumerate(all_reduce_sum_(flags, info.world_size).tolist()) if f]
    if cfg.class_export and not holders:
        log.warning("--class_export %s holds no export of the base model on any node: PyTorch", cfg.class_export)
    return (render, holders) if holders else (None, [])


def _pixels(image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32))


@torch.no_grad()
def _generate(pipe, cfg: TrainConfig, models, index: int) -> torch.Tensor:
    """Class image ``index`` as [H, W, 3] float pixel values in 0..255."""
    from xeonsd.trainer.models import autocast

    generator = torch.Generator().manual_seed(mix(CLASS_IMAGE_SEED, index))
    with autocast(models.weight_dtype):
        image = pipe(
            prompt=cfg.class_prompt,  # by name: Flux2KleinPipeline's first argument is an input image
            num_inference_steps=CLASS_STEPS,
            generator=generator,
            height=cfg.resolution,
            width=cfg.resolution,
        ).images[0]
    return _pixels(image)


@dataclass(frozen=True)
class PriorData:
    """The class images' latents, the class prompt's conditioning, their sampling plan and the loss weight."""

    text: object  # the family's PromptConditioning of the one class prompt
    latents: object  # LatentTable of the class images
    plan: SamplingPlan
    weight: float
    count: int

    def examples(self, instance: list[Example]) -> list[Example]:
        """The class examples paired with these instance examples: the same global indices, in the class plan."""
        return [self.plan.example(e.index) for e in instance]

    def join(self, inputs: tuple, instance: list[Example]) -> tuple:
        """``model_inputs`` of the instance examples with those of their class examples appended (rows n..2n)."""
        paired = model_inputs(self.text, self.latents, self.examples(instance))
        joined = [torch.cat([a, b]) for a, b in zip(inputs[:4], paired[:4], strict=True)]
        added = inputs[4]
        if added is not None:  # SDXL: the pooled embedding and the time ids, per example
            added = {k: torch.cat([v, paired[4][k]]) for k, v in added.items()}
        return (*joined, added)


def model_inputs(text, latents, examples: list[Example]) -> tuple:
    """(sampled latents, noise, timesteps (σ for flow models), text hidden states, the added conditioning or None)
    of these examples; the added conditioning holds their reference images' latents (``references``, a tuple of
    [b, c, h, w], one per reference image) when the run trains on image pairs."""
    hidden, added = text.unet_inputs(latents, examples)
    if getattr(latents, "references", None):  # edit training: each example's reference images' latents
        added = {**(added or {}), "references": tuple(t.sample(examples) for t in latents.references)}
    noise = torch.stack([e.noise for e in examples])
    if examples[0].sigma is not None:  # rectified flow: each example's σ
        timesteps = torch.tensor([e.sigma for e in examples], dtype=torch.float32)
    else:
        timesteps = torch.tensor([e.timestep for e in examples], dtype=torch.long)
    return latents.sample(examples), noise, timesteps, hidden, added


def class_text(cfg: TrainConfig, info: RankInfo, models, trainable: bool = False):
    """The class prompt's conditioning: encoded once with the frozen encoder (``trainable``: the method trains the
    text encoder, so it is encoded every step, as the instance prompts: a table made at set-up would hold the
    encoder of the step the run started or resumed at). Built with the training prompts, before the VAE encodes."""

    table = PromptTable((cfg.class_prompt,), per_image=False, source="--class_prompt")
    return models.training.conditioning(models, table, trainable=trainable, rank=info.rank, world=info.world_size)


def build_prior(
    cfg: TrainConfig,
    info: RankInfo,
    models,
    class_images: list[Path],
    seed: int,
    like: SamplingPlan,
    text,
):
    """The class side of the steps: latents (built like the instance ones), the class prompt's conditioning
    (``text``, from :func:`class_text`), and a sampling plan of its own with the instance plan's timesteps and
    noise options."""
    from xeonsd.trainer.latents import LatentTable

    latents = LatentTable.build(cfg, models, class_images, info.rank, info.local_rank, info.world_size)
    plan = SamplingPlan(
        seed=stream_seed(seed, Stream.PRIOR_PLAN),
        num_images=len(class_images),
        num_templates=1,
        num_timesteps=like.num_timesteps,
        latent_shape=latents.shape,
        flip_p=like.flip_p,
        timestep_range=like.timestep_range,
        noise_offset=like.noise_offset,
        flow=like.flow,
    )
    return PriorData(text=text, latents=latents, plan=plan, weight=cfg.prior_loss_weight, count=len(class_images))
