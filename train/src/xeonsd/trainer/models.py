"""The trainer's models: loading them in the training dtype, fingerprinting the base, writing pipelines and previews.

The frozen UNet and VAE are held in bf16 on AMX (``--mixed_precision bf16``); a UNet that trains (``--method
full``) keeps fp32 master weights and runs under bf16 autocast. The text encoder stays fp32: gradients flow
through it (textual inversion, LoRA on the text encoder), and it is small.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from xeonsd.fsutil import atomic_dir
from xeonsd.modelfiles.families import Family, FamilyError, detect_family, family_spec
from xeonsd.trainer.config import ConfigError, TrainConfig
from xeonsd.trainer.embeddings import PlaceholderEmbedding
from xeonsd.trainer.weights import load_frozen

log = logging.getLogger("xeonsd.train")

__all__ = ["ConfigError", "Models", "autocast", "load_models", "save_full_pipeline"]


@dataclass
class Models:
    tokenizer: object
    text_encoder: torch.nn.Module
    vae: torch.nn.Module | None  # released after the latent cache when nothing else needs it
    unet: torch.nn.Module
    noise_scheduler: object
    weight_dtype: torch.dtype
    ipex: bool
    family: Family | None = None  # None: SD 1.x/2.x (models built by hand in the tests)
    tokenizer_2: object | None = None  # SDXL's second tokenizer and text encoder (OpenCLIP bigG, with projection)
    text_encoder_2: torch.nn.Module | None = None

    @property
    def text_pairs(self) -> list[tuple[object, torch.nn.Module]]:
        """(tokenizer, text encoder) of each text encoder, in the order their hidden states are concatenated."""
        pairs = [(self.tokenizer, self.text_encoder)]
        if self.text_encoder_2 is not None:
            pairs.append((self.tokenizer_2, self.text_encoder_2))
        return pairs

    @property
    def unet_dtype(self) -> torch.dtype:
        return next(self.unet.parameters()).dtype

    @property
    def unet_autocast(self) -> bool:
        """A fp32 UNet in a bf16 run (full fine-tuning: fp32 master weights) runs its forward under autocast."""
        return self.weight_dtype == torch.bfloat16 and self.unet_dtype == torch.float32


def model_family(cfg: TrainConfig) -> Family:
    """The base model's family, read from its config files (a family we do not serve: one-line ConfigError)."""
    try:
        return detect_family(cfg.pretrained_model_name_or_path, cfg.revision)
    except FamilyError as exc:
        raise ConfigError(str(exc)) from exc


def load_models(cfg: TrainConfig, unet_fp32: bool = False, family: Family | None = None) -> Models:
    family = family or model_family(cfg)
    try:
        return _load_models(cfg, unet_fp32, family)
    except OSError as exc:  # missing files, or a Hub id that cannot be fetched (offline, gated, wrong name)
        raise ConfigError(f"cannot load the model {cfg.pretrained_model_name_or_path!r}: {exc}") from exc


def _load_models(cfg: TrainConfig, unet_fp32: bool, family: Family) -> Models:
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel

    src = cfg.pretrained_model_name_or_path
    kw = {"revision": cfg.revision}
    noise_scheduler = DDPMScheduler.from_pretrained(src, subfolder="scheduler", **kw)
    weight_dtype = torch.bfloat16 if cfg.mixed_precision == "bf16" else torch.float32
    text = _load_text_encoders(cfg, family)
    (tokenizer, text_encoder), second = text[0], (text[1] if len(text) > 1 else (None, None))
    # Read tensor by tensor into their dtype: no whole fp32 copy beside the cast one (that was the peak memory).
    vae = load_frozen(AutoencoderKL, src, "vae", weight_dtype, cfg.variant, cfg.revision)
    unet_dtype = torch.float32 if unet_fp32 else weight_dtype
    unet = load_frozen(UNet2DConditionModel, src, "unet", unet_dtype, cfg.variant, cfg.revision)
    for m in (vae, unet):
        m.requires_grad_(False)
        m.eval()
    if cfg.channels_last:
        unet.to(memory_format=torch.channels_last)
    ipex = False
    if cfg.use_ipex != "off" and not unet_fp32:
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
    return Models(tokenizer, text_encoder, vae, unet, noise_scheduler, weight_dtype, ipex, family, second[0], second[1])


def _load_text_encoders(cfg: TrainConfig, family: Family) -> list[tuple[object, torch.nn.Module]]:
    """(tokenizer, text encoder) of each of the family's text encoders, frozen and fp32; the last one with its
    projection when the family conditions on its pooled output (SDXL's ``text_embeds``)."""
    import transformers
    from transformers import CLIPTokenizer

    src, kw = cfg.pretrained_model_name_or_path, {"revision": cfg.revision}
    pairs = []
    for i, (encoder_name, tokenizer_name) in enumerate(family.spec.text_side):
        cls = getattr(transformers, family.spec.text_encoder_class(i))
        tokenizer = CLIPTokenizer.from_pretrained(src, subfolder=tokenizer_name, **kw)
        encoder = cls.from_pretrained(src, subfolder=encoder_name, variant=cfg.variant, **kw)
        encoder.requires_grad_(False)
        encoder.eval()
        pairs.append((tokenizer, encoder.float()))
    return pairs


def pipeline_class(family: Family | None):
    """The diffusers pipeline class of the family (SD 1.x/2.x when unknown)."""
    import diffusers

    return getattr(diffusers, family_spec(family).pipeline_class)


def autocast(dtype: torch.dtype) -> contextlib.AbstractContextManager:
    if dtype == torch.bfloat16:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


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


def inference_pipeline(models: Models):
    """The family's diffusers pipeline over the loaded models (DPM-Solver, no safety checker, quiet): what the
    validation images and the class images of prior preservation are generated with."""
    from diffusers import DPMSolverMultistepScheduler

    spec = family_spec(models.family)
    parts = {
        "vae": models.vae,
        "unet": models.unet,
        "scheduler": DPMSolverMultistepScheduler.from_config(models.noise_scheduler.config),
        **dict(spec.pipeline_kwargs),
    }
    for (encoder_name, tokenizer_name), (tokenizer, encoder) in zip(spec.text_side, models.text_pairs, strict=True):
        parts.update({encoder_name: encoder, tokenizer_name: tokenizer})
    cls = pipeline_class(models.family)
    for name, param in inspect.signature(cls.__init__).parameters.items():  # components training has none of
        if name != "self" and param.default is inspect.Parameter.empty:
            parts.setdefault(name, None)
    pipe = cls(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def render_validation(cfg: TrainConfig, models: Models, target: Path, seed: int) -> None:
    pipe = inference_pipeline(models)
    generator = torch.Generator().manual_seed(seed)
    with atomic_dir(target, overwrite=True) as tmp, torch.no_grad(), autocast(models.weight_dtype):
        for i in range(cfg.num_validation_images):
            image = pipe(
                cfg.validation_prompt,
                num_inference_steps=25,
                generator=generator,
                height=cfg.resolution,
                width=cfg.resolution,
            ).images[0]
            image.save(tmp / f"{i:02d}.png")
    log.info("validation images in %s", target)
