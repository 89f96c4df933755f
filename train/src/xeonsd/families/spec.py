"""What a model family is: :class:`FamilySpec` (its pipeline's files and classes, its text side, its objective,
what its LoRA and concept files look like, what OpenVINO GenAI applies of them, its pipeline's defaults) and, loaded
on first use, its training side (:attr:`FamilySpec.training`, the module ``training`` of the family's folder).

Each family's folder (``xeonsd/families/<name>/``) defines its ``SPEC``; :mod:`xeonsd.families.registry` lists them.
Code outside the family folders asks the spec it was handed (``spec.concept_layout``, ``spec.genai_adapters``,
``spec.training.predict``) and never compares a family's name (docs/trainer.md, "Adding a family").

Standard library only: the playbooks' filter plugins read the specs on the controller without torch.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xeonsd.families.training import TrainFamily


class FamilyError(ValueError):
    """The pipeline is of a family we do not serve, or its config files cannot be read; one line."""


def tokenizer_limit(src: str | Path, subfolder: str) -> int | None:
    """A pipeline directory's tokenizer ``model_max_length`` (``SUBFOLDER/tokenizer_config.json``); None where the
    file or the value is missing or unreadable (a Hub id, or a config without a limit)."""
    config = Path(src).expanduser() / subfolder / "tokenizer_config.json"
    try:
        value = json.loads(config.read_text()).get("model_max_length")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int | float) and value else None


@dataclass(frozen=True)
class FamilySpec:
    """What the files of a family's pipeline look like, and which classes load and export it: read by the trainer
    (its ``training`` module holds the family's training side) and by the OpenVINO side alike.
    ``text_encoders`` and ``tokenizers`` are the pipeline's component names in the order their hidden states are
    concatenated; ``pooled`` says the last text encoder's pooled, projected output conditions the model too."""

    name: str
    label: str
    pipeline_class: str  # diffusers
    ov_pipeline_class: str  # optimum.intel's; empty: optimum-intel exports no such pipeline
    text_encoders: tuple[str, ...]
    tokenizers: tuple[str, ...]
    pooled: bool = False
    # extra keyword arguments of the diffusers pipeline's from_pretrained / constructor
    pipeline_kwargs: tuple[tuple[str, Any], ...] = ()
    # the pipeline's own settings in model_index.json (not components) that its constructor takes and training reads
    # (Krea 2: the text encoder's tapped layers, whether the checkpoint is the distilled Turbo): detection reads
    # them into ``Family.pipeline_config``
    pipeline_config: tuple[str, ...] = ()
    # the denoiser's component name and diffusers class, and the VAE's; a UNet family's ``addition_embed_type`` in
    # its UNet config (SDXL: "text_time"), which tells the UNet families apart
    denoiser: str = "unet"
    addition_embed_type: str | None = None
    denoiser_class: str = "UNet2DConditionModel"
    vae_class: str = "AutoencoderKL"
    # the transformers class of each text encoder, in ``text_encoders`` order; empty: CLIP (see text_encoder_class)
    encoder_classes: tuple[str, ...] = ()
    # the training objective: "noise" (epsilon/v-prediction on a DDPM schedule) or "flow" (rectified flow)
    objective: str = "noise"
    # latent side lengths must be a multiple of this (FLUX packs 2x2 latents into one token)
    latent_multiple: int = 1
    # the long text encoder's prompt length: diffusers' default ``max_sequence_length`` of the family's pipeline
    # (T5: FluxPipeline 512, StableDiffusion3Pipeline 256; Qwen: Flux2KleinPipeline 512); None: CLIP only
    max_sequence_length: int | None = None
    # CLIP tokens that join the long encoder's along the token axis in the denoiser's text input (SD3: 77)
    clip_context_tokens: int = 0
    # textual inversion's file layout: "sd" (one vector set), "xl" (clip_l and clip_g); None: not trained here
    concept_layout: str | None = None
    # LoRA files: the kohya/ComfyUI writer ("unet": SD/SDXL names, "bfl": BFL's fused FLUX.1 names; None: ComfyUI and
    # Forge load the diffusers layout), with the text encoders as lora_te1_/lora_te2_ (SDXL, FLUX.1)
    kohya: str | None = "unet"
    kohya_te_numbered: bool = False
    # what tells an adapter of this family from the others (xeonsd.modelfiles.lora_layout.lora_family): regexes
    # over its kohya module names with the evidence they give, and the widths of its cross-attention's text input
    lora_marks: tuple[tuple[str, str], ...] = ()
    text_widths: tuple[int, ...] = ()
    # its adapters are those of the other family on its denoiser class, and it takes theirs (FLUX.1 Kontext: FLUX.1's
    # transformer; its files cannot be told apart)
    shared_adapters: bool = False
    # OpenVINO GenAI 2026.4.1 applies this family's adapters at generation time (SD3: it has none), and their
    # text-encoder part per request (SDXL: not; the generate CLI fuses that part into a copy of the encoders)
    genai_adapters: bool = True
    genai_text_adapters: bool = True
    # the edits GenAI 2026.4.1 runs on this family's export (Image2ImagePipeline, InpaintingPipeline; measured on
    # the tiny exports: FLUX.2 [klein], Z-Image and Qwen-Image have no inpainting, "Unsupported inpainting pipeline")
    genai_edits: tuple[str, ...] = ("image2image", "inpainting")
    # the edits the PyTorch engine runs for a family without reference images, each by its diffusers pipeline (made
    # from the served pipeline with ``from_pipe``, sharing its modules): diffusers 0.39's Img2Img and Inpaint classes
    torch_edits: tuple[tuple[str, str], ...] = ()
    # the pipeline's default guidance scale, and whether it runs classifier-free guidance with an (empty)
    # negative prompt at that scale (two denoiser calls' worth per step)
    guidance_scale: float = 7.5
    negative_prompt_cfg: bool = True
    # the flow families' σ density and loss weight by default (--weighting_scheme), as the family's diffusers
    # script defaults to
    weighting_scheme: str = "none"
    # σ of a scheduler with use_dynamic_shifting: shifted by the image's token count (FLUX.1, as it was trained), or
    # False: the scheduler's unshifted training grid, the sigmas diffusers' Qwen-Image and FLUX.2 scripts index
    resolution_shift: bool = True
    # the diffusers pipelines this family trains as (the ``_class_name`` of model_index.json; empty: its
    # ``pipeline_class`` only), and pipelines on this family's denoiser that train otherwise (edit models that take
    # reference images), each with what it is: refused before any weight loads
    pipeline_aliases: tuple[str, ...] = ()
    variants: tuple[tuple[str, str], ...] = ()
    # the reference images its pipeline takes beside the prompt (``image=``), and so edit training on image pairs
    # (--cond_image_column): 0 for a text-to-image-only model
    reference_images: int = 0
    # its pipeline cannot run without a reference image (Qwen-Image-Edit-2511): it trains on pairs only
    reference_required: bool = False
    # the pipeline's processor component, loaded beside the tokenizers: the image side of a text encoder that reads
    # the reference images (Qwen-Image-Edit's Qwen2VLProcessor); None: none
    processor: str | None = None
    # diffusers' own training script for a method, under a diffusers checkout's examples/ (what `xeonsd bench train
    # --diffusers-examples` runs beside ours): (method, path)
    example_scripts: tuple[tuple[str, str], ...] = ()

    def prompt_length(self, tokenizer_limit: float | None) -> int | None:
        """T5's prompt length: the pipeline's default, or the T5 tokenizer's ``model_max_length`` where that is
        shorter (the tiny models' 32); None for the CLIP-only families. The trainer's tables, the memory estimate,
        the export (which fixes it in a static export) and every engine use this one rule."""
        if self.max_sequence_length is None:
            return None
        return (
            self.max_sequence_length if tokenizer_limit is None else min(self.max_sequence_length, int(tokenizer_limit))
        )

    def prompt_length_of(self, src: str | Path) -> int | None:
        """:meth:`prompt_length` with the limit read from the pipeline directory's T5 tokenizer config (the
        default where there is no such file: a Hub id, or a config without a limit)."""
        limit = None if self.max_sequence_length is None else tokenizer_limit(src, self.tokenizers[-1])
        return self.prompt_length(limit)

    @property
    def text_side(self) -> tuple[tuple[str, str], ...]:
        """(text encoder, tokenizer) component names, in order."""
        return tuple(zip(self.text_encoders, self.tokenizers, strict=True))

    def text_encoder_class(self, index: int) -> str:
        """The transformers class of text encoder ``index``: the last one with its projection when the family
        conditions on its pooled output."""
        if self.encoder_classes:
            return self.encoder_classes[index]
        last = index == len(self.text_encoders) - 1
        return "CLIPTextModelWithProjection" if self.pooled and last else "CLIPTextModel"

    @property
    def clip_encoders(self) -> tuple[str, ...]:
        """The CLIP text encoders (what a concept or a LoRA can touch; T5 and the decoder LLMs take neither)."""
        return tuple(e for i, e in enumerate(self.text_encoders) if self.text_encoder_class(i).startswith("CLIP"))

    @property
    def pipelines(self) -> tuple[str, ...]:
        """The diffusers pipeline classes a model of this family is trained as."""
        return (self.pipeline_class, *self.pipeline_aliases)

    @property
    def training(self) -> TrainFamily:
        """The family's training side: the ``TRAINING`` strategy of ``xeonsd.families.<name>.training``, imported
        on first use (it needs torch and the trainer; the spec itself is the standard library's)."""
        return importlib.import_module(f"xeonsd.families.{self.name}.training").TRAINING

    @property
    def assets(self) -> ModuleType:
        """The family's offline pipelines, ``xeonsd.families.<name>.assets``: its ``ARCHS`` (``make-tiny-model
        --arch``: the tiny ones for the tests, the real widths for the benchmarks) and ``make``."""
        return importlib.import_module(f"xeonsd.families.{self.name}.assets")
