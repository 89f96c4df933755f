"""The trainer's models: loading them in the training dtype, in phases or at once, shared by a node's ranks or not
(what is made of them besides training: :mod:`.pipelines`).

The frozen UNet and VAE are held in bf16 on AMX (``--mixed_precision bf16``); a UNet that trains (``--method
full``) keeps fp32 master weights and runs under bf16 autocast. The text encoder stays fp32: gradients flow
through it (textual inversion, LoRA on the text encoder), and it is small.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from xeonsd.families import Family, FamilyError, detect_family, family_spec
from xeonsd.modelfiles.modelsource import model_fingerprint
from xeonsd.trainer import sharding
from xeonsd.trainer.config import ConfigError, TrainConfig
from xeonsd.trainer.flow import FlowSchedule, resolve_scheme
from xeonsd.trainer.shared_weights import Component, SharedStore
from xeonsd.trainer.weights import WEIGHTS_NAME, empty_model, load_frozen, local_weight_files

if TYPE_CHECKING:
    from xeonsd.families.training import TrainFamily

log = logging.getLogger("xeonsd.train")

__all__ = ["ConfigError", "Models", "autocast", "load_models"]


@dataclass
class Models:
    """The loaded models. ``unet`` is the denoiser: the UNet, or a flow family's transformer (FLUX.1, SD3)."""

    tokenizer: object
    text_encoder: torch.nn.Module
    vae: torch.nn.Module | None  # released after the latent cache when nothing else needs it
    unet: torch.nn.Module  # (None only until load_denoiser adds it: loads_in_phases)
    noise_scheduler: object
    weight_dtype: torch.dtype
    ipex: bool
    family: Family | None = None  # None: SD 1.x/2.x (models built by hand in the tests)
    tokenizer_2: object | None = None  # SDXL's second tokenizer and text encoder (OpenCLIP bigG, with projection)
    text_encoder_2: torch.nn.Module | None = None  # (FLUX.1: T5)
    tokenizer_3: object | None = None  # SD3: T5
    text_encoder_3: torch.nn.Module | None = None
    flow: FlowSchedule | None = None  # flow families: how σ is drawn and weighted (xeonsd.trainer.flow)
    # flow families, once T5 is freed: the validation prompt's embeddings for the pipeline (the family's
    # conditioning of (validation prompt, ""), with ``pipeline_kwargs()``)
    sample_conditioning: object | None = None
    # edit training (--cond_image_column): the reference images the validation prompt's images are made from (the
    # first training image's)
    sample_reference: tuple[Path, ...] | None = None
    # the pipeline's processor, where its text encoder reads images (Qwen-Image-Edit: FamilySpec.processor)
    processor: object | None = None
    # --share_weights: the node's store, and the shared component behind each slot ("vae" -> "vae", …)
    store: SharedStore | None = None
    shared_slots: dict[str, str] = dataclasses.field(default_factory=dict)
    # loaded in phases, a flow family's CLIP encoders wait until the long one is freed: slot -> its loader
    text_pending: dict[str, object] = dataclasses.field(default_factory=dict)

    def free(self, slot: str) -> None:
        """Drop the frozen model in ``slot`` (``vae``, ``text_encoder_3``, …) that this rank no longer needs; with
        shared weights the node's last rank to drop it removes its file (:meth:`SharedStore.release`)."""
        setattr(self, slot, None)
        gc.collect()
        self.unshare(slot)

    def load_pending(self) -> None:
        """Load the text encoders that waited for the long one to be freed (:func:`load_models` in phases)."""
        for slot, load in self.text_pending.items():
            setattr(self, slot, load())
            log.info("%s loaded, after the long text encoder was freed", type(getattr(self, slot)).__name__)
        self.text_pending.clear()

    def unshare(self, slot: str) -> None:
        """This rank's model in ``slot`` no longer uses its shared file (--fsdp's shards are copies of their own):
        the node's last rank to let go of it removes the file."""
        if self.store is not None and slot in self.shared_slots:
            self.store.release(self.shared_slots.pop(slot))

    @property
    def text_pairs(self) -> list[tuple[object, torch.nn.Module | None]]:
        """(tokenizer, text encoder) of each text encoder, in the order their hidden states are concatenated (a
        flow family's T5 is None once freed)."""
        pairs = [(self.tokenizer, self.text_encoder)]
        for tok, enc in ((self.tokenizer_2, self.text_encoder_2), (self.tokenizer_3, self.text_encoder_3)):
            if tok is not None:
                pairs.append((tok, enc))
        return pairs

    @property
    def text_length(self) -> int:
        """A flow family's T5 tokens per prompt: its pipeline's default ``max_sequence_length`` (FLUX.1 512, SD3
        256), at most the tokenizer's own limit (the tiny test models' 32): ``FamilySpec.prompt_length``."""
        return family_spec(self.family).prompt_length(self.text_pairs[-1][0].model_max_length)

    @property
    def training(self) -> TrainFamily:
        """The family's training side (:attr:`xeonsd.families.FamilySpec.training`): its conditioning, latents,
        objective and LoRA targets."""
        return family_spec(self.family).training

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


def load_models(
    cfg: TrainConfig,
    unet_fp32: bool = False,
    family: Family | None = None,
    store: SharedStore | None = None,
    denoiser: bool = True,
) -> Models:
    """The models in their training dtypes; with ``store`` the frozen ones are mapped from the node's shared files
    (:mod:`.shared_weights`), a UNet that trains (``unet_fp32``) stays private. ``denoiser`` False: all but the
    denoiser, which :func:`load_denoiser` adds (:func:`loads_in_phases`), and a flow family's CLIP encoders wait
    in ``text_pending`` until its long text encoder is freed (:meth:`Models.load_pending`)."""
    family = family or model_family(cfg)
    with _model_files(cfg):
        models = _load_models(cfg, family, store, defer_clip=not denoiser)
    if denoiser:
        load_denoiser(cfg, models, unet_fp32)
    return models


def load_denoiser(cfg: TrainConfig, models: Models, unet_fp32: bool = False) -> None:
    """The denoiser into ``models``, which :func:`load_models` loaded without it."""
    with _model_files(cfg):
        _load_denoiser(cfg, models, unet_fp32)


@contextlib.contextmanager
def _model_files(cfg: TrainConfig) -> Iterator[None]:
    """Missing files, or a Hub id that cannot be fetched (offline, gated, wrong name): a one-line ConfigError."""
    try:
        yield
    except OSError as exc:
        raise ConfigError(f"cannot load the model {cfg.pretrained_model_name_or_path!r}: {exc}") from exc


def loads_in_phases(cfg: TrainConfig, text_first: bool, store: SharedStore | None) -> bool:
    """Whether the denoiser loads last, after the prompts are encoded (a long text encoder freed) and the latents
    cached (the VAE freed): the loading peak is then the larger phase's, not every model at once. Not when the
    method's prompts need the method first (``text_first`` False: textual inversion's new tokens, LoRA on the text
    encoders), with prior preservation (the whole pipeline renders the class images first), nor when IPEX
    optimises the UNet and the VAE together."""
    import importlib.util

    ipex = cfg.use_ipex != "off" and store is None and importlib.util.find_spec("intel_extension_for_pytorch")
    return cfg.phased_loading and text_first and not cfg.with_prior_preservation and not ipex


def _load_models(cfg: TrainConfig, family: Family, store: SharedStore | None, defer_clip: bool = False) -> Models:
    import diffusers
    from diffusers import DDPMScheduler

    src = cfg.pretrained_model_name_or_path
    kw = {"revision": cfg.revision}
    spec = family.spec
    flow = None
    if family.is_flow:
        noise_scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(src, subfolder="scheduler", **kw)
        scheme = resolve_scheme(cfg.weighting_scheme, spec.weighting_scheme)
        flow = FlowSchedule.from_config(
            noise_scheduler.config, scheme, cfg.logit_mean, cfg.logit_std, cfg.mode_scale, cfg.guidance_scale
        )
        if not spec.resolution_shift and flow.dynamic:  # the unshifted grid (it ignores the static shift then)
            flow = dataclasses.replace(flow, dynamic=False, shift=1.0)
    else:
        noise_scheduler = DDPMScheduler.from_pretrained(src, subfolder="scheduler", **kw)
    weight_dtype = torch.bfloat16 if cfg.mixed_precision == "bf16" else torch.float32
    text, pending = _load_text_encoders(cfg, family, weight_dtype, store, defer_clip)
    text += [(None, None)] * (3 - len(text))
    # Read tensor by tensor into their dtype: no whole fp32 copy beside the cast one (that was the peak memory).
    vae_cls = getattr(diffusers, spec.vae_class)  # Qwen-Image: AutoencoderKLQwenImage
    vae = _frozen(cfg, store, vae_cls, "vae", weight_dtype)
    vae.requires_grad_(False)
    vae.eval()
    (tokenizer, text_encoder), (tok2, enc2), (tok3, enc3) = text
    models = Models(
        tokenizer, text_encoder, vae, None, noise_scheduler, weight_dtype, False, family, tok2, enc2, tok3, enc3, flow
    )
    models.text_pending = pending
    if spec.processor:  # the vision side of the text encoder's inputs (Qwen-Image-Edit's reference images)
        models.processor = spec.training.load_processor(src, spec.processor, tokenizer, **kw)
    if store is not None:
        text_slots = zip(_TEXT_SLOTS, (encoder for encoder, _ in spec.text_side), strict=False)
        models = dataclasses.replace(models, store=store, shared_slots={"vae": "vae", **dict(text_slots)})
    return models


def _load_denoiser(cfg: TrainConfig, models: Models, unet_fp32: bool) -> None:
    import diffusers

    family, store, weight_dtype = models.family, models.store, models.weight_dtype
    spec = family.spec
    unet_dtype = torch.float32 if unet_fp32 else weight_dtype
    denoiser_cls = getattr(diffusers, spec.denoiser_class)
    channels_last = cfg.channels_last and not family.is_flow
    # A denoiser that trains is this rank's own, unless --fsdp shards it: then the node's ranks map one whole copy,
    # and each keeps its shards of it and lets go of the copy (xeonsd.trainer.methods.full)
    denoiser_store = store if not unet_fp32 or sharding.shards(cfg) else None
    unet = _frozen(cfg, denoiser_store, denoiser_cls, spec.denoiser, unet_dtype, channels_last)
    unet.requires_grad_(False)
    unet.eval()
    if denoiser_store is not None:
        models.shared_slots["unet"] = spec.denoiser
    if channels_last:  # a no-op on weights mapped from the shared file: stored channels last already
        unet.to(memory_format=torch.channels_last)
    if cfg.use_ipex != "off" and not unet_fp32 and not family.is_flow and store is None:  # IPEX rewrites weights
        try:
            import intel_extension_for_pytorch as ipex_mod  # type: ignore[import-not-found]
        except ImportError:
            if cfg.use_ipex == "on":
                raise ConfigError("--use_ipex on, but intel_extension_for_pytorch does not import") from None
        else:  # (the VAE too: loads_in_phases keeps it until now)
            unet = ipex_mod.optimize(unet, dtype=weight_dtype, inplace=True)
            models.vae = ipex_mod.optimize(models.vae, dtype=weight_dtype, inplace=True)
            models.ipex = True
    if cfg.compile:
        unet = torch.compile(unet)
    models.unet = unet


_TEXT_SLOTS = ("text_encoder", "text_encoder_2", "text_encoder_3")


def _load_text_encoders(
    cfg: TrainConfig, family: Family, weight_dtype: torch.dtype, store: SharedStore | None, defer_clip: bool = False
) -> tuple[list[tuple[object, torch.nn.Module | None]], dict[str, object]]:
    """(tokenizer, text encoder) of each of the family's text encoders, frozen; the CLIP ones in fp32 (gradients
    may flow through them), the last with its projection when the family conditions on its pooled output
    (SDXL's ``text_embeds``); a long text encoder (T5 in FLUX.1 and SD3, Qwen in FLUX.2 [klein], Z-Image and
    Qwen-Image) in the training dtype: it never trains, and in fp32 T5-XXL alone is 19 GB, Qwen2.5-VL-7B 33 GB.
    ``defer_clip`` (loading in phases) with a long encoder: the CLIP ones are not loaded but returned as loaders
    (slot -> loader), so that they load once the long one is freed and never beside it."""
    import transformers
    from transformers import AutoTokenizer, CLIPTokenizer

    src, kw = cfg.pretrained_model_name_or_path, {"revision": cfg.revision}
    spec = family.spec
    longs = [not spec.text_encoder_class(i).startswith("CLIP") for i in range(len(spec.text_side))]
    pairs, pending = [], {}
    for i, (encoder_name, tokenizer_name) in enumerate(spec.text_side):
        cls = getattr(transformers, spec.text_encoder_class(i))
        long = longs[i]
        tokenizer = (AutoTokenizer if long else CLIPTokenizer).from_pretrained(src, subfolder=tokenizer_name, **kw)
        dtype = weight_dtype if long else torch.float32
        whole = functools.partial(
            cls.from_pretrained, src, subfolder=encoder_name, variant=cfg.variant, torch_dtype=dtype, **kw
        )

        def load(cls=cls, encoder_name=encoder_name, dtype=dtype, whole=whole, long=long) -> torch.nn.Module:
            encoder = _frozen(cfg, store, cls, encoder_name, dtype, whole=whole)
            encoder.requires_grad_(False)
            return encoder.eval() if long else encoder.eval().float()

        if defer_clip and not long and any(longs):
            pending[_TEXT_SLOTS[i]] = load
            pairs.append((tokenizer, None))
        else:
            pairs.append((tokenizer, load()))
    return pairs, pending


def _frozen(
    cfg: TrainConfig,
    store: SharedStore | None,
    model_cls,
    subfolder: str,
    dtype: torch.dtype,
    channels_last: bool = False,
    whole=None,
) -> torch.nn.Module:
    """A frozen component in ``dtype``: mapped from the node's shared file with ``store`` (built there first by
    the node's first rank), else this rank's own copy (``whole``, by default read tensor by tensor)."""
    src = cfg.pretrained_model_name_or_path
    if whole is None:
        whole = functools.partial(load_frozen, model_cls, src, subfolder, dtype, cfg.variant, cfg.revision)
    if store is None:
        return whole()
    diffusers_model = hasattr(model_cls, "load_config")
    component = Component(
        name=subfolder,
        empty=functools.partial(empty_model, model_cls, src, subfolder, cfg.revision),
        files=local_weight_files(
            src, subfolder, cfg.variant, cfg.revision, WEIGHTS_NAME if diffusers_model else "model"
        ),
        dtype=dtype,
        load_whole=whole,
        fingerprint=f"{model_fingerprint(src, cfg.revision, subfolder=subfolder)}:{cfg.variant}",
        channels_last=channels_last,
    )
    return store.load(component)


def autocast(dtype: torch.dtype) -> contextlib.AbstractContextManager:
    if dtype == torch.bfloat16:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()
