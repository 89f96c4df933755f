"""The trainer's models: loading the frozen parts in the training dtype, and writing pipelines and previews.

UNet and VAE are frozen (bf16 on AMX with ``--mixed_precision bf16``); the text encoder stays fp32 because the
gradient flows through it to the concept's vectors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from xeonsd.config import TrainConfig
from xeonsd.embeddings import PlaceholderEmbedding
from xeonsd.fsutil import atomic_dir

log = logging.getLogger("xeonsd.train")


class ConfigError(ValueError):
    """A flag value that cannot work; raised before any model is loaded."""


@dataclass
class Models:
    tokenizer: object
    text_encoder: torch.nn.Module
    vae: torch.nn.Module | None  # released after the latent cache when nothing else needs it
    unet: torch.nn.Module
    noise_scheduler: object
    weight_dtype: torch.dtype
    ipex: bool


def load_models(cfg: TrainConfig) -> Models:
    try:
        return _load_models(cfg)
    except OSError as exc:  # missing files, or a Hub id that cannot be fetched (offline, gated, wrong name)
        raise ConfigError(f"cannot load the model {cfg.pretrained_model_name_or_path!r}: {exc}") from exc


def _load_models(cfg: TrainConfig) -> Models:
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    src = cfg.pretrained_model_name_or_path
    kw = {"revision": cfg.revision}
    tokenizer = CLIPTokenizer.from_pretrained(src, subfolder="tokenizer", **kw)
    noise_scheduler = DDPMScheduler.from_pretrained(src, subfolder="scheduler", **kw)
    weight_dtype = torch.bfloat16 if cfg.mixed_precision == "bf16" else torch.float32
    text_encoder = CLIPTextModel.from_pretrained(src, subfolder="text_encoder", variant=cfg.variant, **kw)
    vae = AutoencoderKL.from_pretrained(src, subfolder="vae", variant=cfg.variant, torch_dtype=weight_dtype, **kw)
    unet = UNet2DConditionModel.from_pretrained(
        src, subfolder="unet", variant=cfg.variant, torch_dtype=weight_dtype, **kw
    )
    for m in (text_encoder, vae, unet):
        m.requires_grad_(False)
        m.eval()
    text_encoder.float()
    if cfg.channels_last:
        unet.to(memory_format=torch.channels_last)
    ipex = False
    if cfg.use_ipex != "off":
        try:
            import intel_extension_for_pytorch as ipex_mod  # type: ignore[import-not-found]
        except ImportError:
            if cfg.use_ipex == "on":
                raise ConfigError("--use_ipex on, but intel_extension_for_pytorch does not import") from None
        else:
            unet = ipex_mod.optimize(unet, dtype=weight_dtype, inplace=True)
            vae = ipex_mod.optimize(vae, dtype=weight_dtype, inplace=True)
            ipex = True
    if cfg.compile:
        unet = torch.compile(unet)
    return Models(tokenizer, text_encoder, vae, unet, noise_scheduler, weight_dtype, ipex)


def autocast(dtype: torch.dtype) -> contextlib.AbstractContextManager:
    if dtype == torch.bfloat16:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def save_full_pipeline(cfg: TrainConfig, tokenizer, text_encoder, target: Path) -> None:
    """A complete pipeline in ``target`` (as the recipe: the output dir loads with ``from_pretrained``), with the
    concept in tokenizer and text encoder; UNet and VAE are re-read in full precision, not the bf16 copies.

    Written in a temporary directory first; components are moved in and ``model_index.json`` comes last, so a
    crash never leaves a directory that looks like a complete pipeline."""
    from diffusers import StableDiffusionPipeline

    emb = text_encoder.get_input_embeddings()
    if isinstance(emb, PlaceholderEmbedding):
        text_encoder.set_input_embeddings(emb.merged())
    try:
        pipe = StableDiffusionPipeline.from_pretrained(
            cfg.pretrained_model_name_or_path, text_encoder=text_encoder, tokenizer=tokenizer,
            revision=cfg.revision, variant=cfg.variant, safety_checker=None, requires_safety_checker=False,
        )  # fmt: skip
        with tempfile.TemporaryDirectory(prefix=".pipeline.tmp-", dir=target) as tmp:
            pipe.save_pretrained(tmp, safe_serialization=True)
            (target / "model_index.json").unlink(missing_ok=True)
            for item in sorted(Path(tmp).iterdir(), key=lambda p: p.name == "model_index.json"):
                dest = target / item.name
                if dest.is_dir():
                    shutil.rmtree(dest)
                os.replace(item, dest)
    finally:
        text_encoder.set_input_embeddings(emb)


def render_validation(cfg: TrainConfig, models: Models, target: Path, seed: int) -> None:
    from diffusers import DPMSolverMultistepScheduler, StableDiffusionPipeline

    pipe = StableDiffusionPipeline(
        vae=models.vae, text_encoder=models.text_encoder, tokenizer=models.tokenizer, unet=models.unet,
        scheduler=DPMSolverMultistepScheduler.from_config(models.noise_scheduler.config),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(seed)
    with atomic_dir(target, overwrite=True) as tmp, torch.no_grad(), autocast(models.weight_dtype):
        for i in range(cfg.num_validation_images):
            image = pipe(cfg.validation_prompt, num_inference_steps=25, generator=generator,
                         height=cfg.resolution, width=cfg.resolution).images[0]  # fmt: skip
            image.save(tmp / f"{i:02d}.png")
    log.info("validation images in %s", target)
