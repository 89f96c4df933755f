"""What the trainer makes of its models besides training them: the family's diffusers pipeline over the loaded
models (the validation images, prior preservation's class images), the validation images themselves, and a
complete pipeline written from the base model with trained components in their place."""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from xeonsd.families import Family, detect_family, family_spec
from xeonsd.fsutil import atomic_dir
from xeonsd.trainer.config import TrainConfig
from xeonsd.trainer.embeddings import PlaceholderEmbedding
from xeonsd.trainer.models import Models, autocast

log = logging.getLogger("xeonsd.train")


def pipeline_class(family: Family | None):
    """The diffusers pipeline class of the family (SD 1.x/2.x when unknown)."""
    import diffusers

    return getattr(diffusers, family_spec(family).pipeline_class)


def save_full_pipeline(
    cfg: TrainConfig, target: Path, family: Family | None = None, **components: torch.nn.Module | object
) -> None:
    """A complete pipeline in ``target`` (the output dir loads with ``from_pretrained``): the base model's
    components, with ``components`` (e.g. ``tokenizer=…, text_encoder=…`` with the concept, or a trained
    ``unet=…``) in their place; the others are re-read in full precision, not the bf16 training copies.

    Written in a temporary directory first; components are moved in and ``model_index.json`` comes last, so a
    crash never leaves a directory that looks like a complete pipeline. ``family``: the pipeline class (SDXL's
    has two text encoders and no safety checker)."""
    swapped = []  # (text encoder, its placeholder module): the trained vectors merged in for the save
    for name in ("text_encoder", "text_encoder_2"):
        encoder = components.get(name)
        emb = encoder.get_input_embeddings() if encoder is not None else None
        if isinstance(emb, PlaceholderEmbedding):
            encoder.set_input_embeddings(emb.merged())
            swapped.append((encoder, emb))
    extra = dict(family_spec(family).pipeline_kwargs)
    try:
        pipe = pipeline_class(family).from_pretrained(
            cfg.pretrained_model_name_or_path, revision=cfg.revision, variant=cfg.variant, **extra, **components
        )
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".pipeline.tmp-", dir=target) as tmp:
            pipe.save_pretrained(tmp, safe_serialization=True)
            (target / "model_index.json").unlink(missing_ok=True)
            for item in sorted(Path(tmp).iterdir(), key=lambda p: p.name == "model_index.json"):
                dest = target / item.name
                if dest.is_dir():
                    shutil.rmtree(dest)
                os.replace(item, dest)
    finally:
        for encoder, emb in swapped:
            encoder.set_input_embeddings(emb)


def inference_pipeline(models: Models, denoiser: torch.nn.Module | None = None, family: Family | None = None):
    """The family's diffusers pipeline over the loaded models (DPM-Solver, or a flow family's own flow-matching
    Euler scheduler; no safety checker, quiet): what the validation images and the class images of prior
    preservation are generated with. ``denoiser`` and ``family``: another model's denoiser and settings in the
    place of the base model's (:func:`inference_denoiser`)."""
    from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler

    spec = family_spec(models.family)
    family = family or models.family
    sampler = FlowMatchEulerDiscreteScheduler if spec.objective == "flow" else DPMSolverMultistepScheduler
    parts = {
        "vae": models.vae,
        spec.denoiser: models.unet if denoiser is None else denoiser,
        "scheduler": sampler.from_config(models.noise_scheduler.config),
        **dict(spec.pipeline_kwargs),
        **(dict(family.pipeline_config) if family is not None else {}),
    }
    for (encoder_name, tokenizer_name), (tokenizer, encoder) in zip(spec.text_side, models.text_pairs, strict=True):
        parts.update({encoder_name: encoder, tokenizer_name: tokenizer})
    if spec.processor:
        parts[spec.processor] = models.processor
    cls = pipeline_class(models.family)
    for name, param in inspect.signature(cls.__init__).parameters.items():  # components training has none of
        if name != "self" and param.default is inspect.Parameter.empty:
            parts.setdefault(name, None)
    pipe = cls(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def inference_denoiser(cfg: TrainConfig, models: Models, family: Family) -> torch.nn.Module:
    """``--inference_model``'s denoiser (of ``family``, the base model's) in the training dtype, with a copy of the
    adapters being trained: what its validation images are rendered with (loaded for each rendering, beside the
    training denoiser, and dropped after it)."""
    import diffusers
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

    from xeonsd.trainer.weights import load_frozen

    spec = family.spec
    cls = getattr(diffusers, spec.denoiser_class)
    denoiser = load_frozen(cls, cfg.inference_model, spec.denoiser, models.unet_dtype, None, None)
    denoiser.requires_grad_(False)
    for name, config in getattr(models.unet, "peft_config", {}).items():  # the run's adapters: their config, weights
        denoiser.add_adapter(config, adapter_name=name)
        set_peft_model_state_dict(denoiser, get_peft_model_state_dict(models.unet, adapter_name=name), name)
    log.info("validation images on %s's %s, with the adapters being trained", cfg.inference_model, spec.denoiser)
    return denoiser.eval()


def pipeline_call_kwargs(models: Models, prompt: str) -> dict:
    """The prompt arguments of the pipeline call: the prompt itself, or a flow family's embeddings of it computed
    before T5 was freed (``models.sample_conditioning``), with its text length."""
    extra = {}
    if models.family is not None and models.family.is_flow:
        extra["max_sequence_length"] = models.text_length
    if models.sample_conditioning is not None:
        return {**models.sample_conditioning.pipeline_kwargs(prompt), **extra}
    return {"prompt": prompt, **extra}


def render_validation(cfg: TrainConfig, models: Models, target: Path | None, seed: int) -> None:
    """The validation prompt's images into ``target``; None: rendered and dropped (a rank that holds shards of the
    denoiser (--fsdp) takes part in every denoiser call of rank 0's rendering)."""
    family = models.family
    if cfg.inference_model is None:
        pipe = inference_pipeline(models)
    else:
        family = detect_family(cfg.inference_model)
        pipe = inference_pipeline(models, inference_denoiser(cfg, models, family), family)
    sampling = models.training.sampling(dict(family.pipeline_config) if family is not None else {})
    generator = torch.Generator().manual_seed(seed)
    place = atomic_dir(target, overwrite=True) if target is not None else tempfile.TemporaryDirectory()
    with place as tmp, torch.no_grad(), autocast(models.weight_dtype), models.training.rendering(cfg.resolution):
        tmp = Path(tmp)
        extra = {}
        takes = inspect.signature(pipe.__call__).parameters
        if "max_area" in takes:  # FLUX.1 Kontext scales to ~1 MP by default: keep --resolution's pixels
            extra["max_area"] = cfg.resolution * cfg.resolution
        if "_auto_resize" in takes:  # and the reference at the size it trained at (its --resolution crop)
            extra["_auto_resize"] = False
        if models.sample_reference:  # edit training: the images are edits of the reference images
            from PIL import Image

            images = []
            for path in models.sample_reference:
                with Image.open(path) as im:
                    images.append(im.convert("RGB"))
            extra["image"] = images[0] if len(images) == 1 else images
        for i in range(cfg.num_validation_images):
            image = pipe(
                **pipeline_call_kwargs(models, cfg.validation_prompt),
                **extra,
                **sampling,
                generator=generator,
                height=cfg.resolution,
                width=cfg.resolution,
            ).images[0]
            image.save(tmp / f"{i:02d}.png")
    if target is not None:
        log.info("validation images in %s", target)
