"""What each model family we serve is, as data: :class:`FamilySpec` (its pipeline's files and classes, its text
side, its objective, what its LoRA and concept files look like, what OpenVINO GenAI applies of them, its pipeline's
defaults) and the table :data:`SPECS` of every family by name.

Code outside the family objects asks a spec (``spec.concept_layout``, ``spec.genai_adapters``) and never compares a
family's name; a new family is one entry here, its detection rule in :mod:`xeonsd.modelfiles.families` and its
training side in :mod:`xeonsd.trainer.families` (docs/trainer.md, "Adding a family").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
    (:mod:`xeonsd.trainer.families` holds each family's training side) and by the OpenVINO side alike.
    ``text_encoders`` and ``tokenizers`` are the pipeline's component names in the order their hidden states are
    concatenated; ``pooled`` says the last text encoder's pooled, projected output conditions the model too."""

    name: str
    label: str
    pipeline_class: str  # diffusers
    ov_pipeline_class: str  # optimum.intel
    text_encoders: tuple[str, ...]
    tokenizers: tuple[str, ...]
    pooled: bool = False
    # extra keyword arguments of the diffusers pipeline's from_pretrained / constructor
    pipeline_kwargs: tuple[tuple[str, Any], ...] = ()
    # the denoiser's component name and diffusers class, and the VAE's
    denoiser: str = "unet"
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
    # OpenVINO GenAI 2026.4.1 applies this family's adapters at generation time (SD3: it has none), and their
    # text-encoder part per request (SDXL: not; the generate CLI fuses that part into a copy of the encoders)
    genai_adapters: bool = True
    genai_text_adapters: bool = True
    # the edits GenAI 2026.4.1 runs on this family's export (Image2ImagePipeline, InpaintingPipeline; measured on
    # the tiny exports: FLUX.2 [klein], Z-Image and Qwen-Image have no inpainting, "Unsupported inpainting pipeline")
    genai_edits: tuple[str, ...] = ("image2image", "inpainting")
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


# Every family we serve, by name (the name is what train_summary.json and an export's manifest record). A new
# family is one entry here (and its rule in family_of) plus its training side in xeonsd.trainer.families.
SPECS: dict[str, FamilySpec] = {
    spec.name: spec
    for spec in (
        FamilySpec(
            "sd",
            "SD 1.x/2.x",
            "StableDiffusionPipeline",
            "OVStableDiffusionPipeline",
            ("text_encoder",),
            ("tokenizer",),
            pipeline_kwargs=(("safety_checker", None), ("requires_safety_checker", False)),
            concept_layout="sd",
            lora_marks=(
                (r"^lora_unet_down_blocks_0_attentions_", "it adapts attention in the UNet's first down block"),
            ),
            text_widths=(768, 1024),
        ),
        FamilySpec(
            "sdxl",
            "SDXL",
            "StableDiffusionXLPipeline",
            "OVStableDiffusionXLPipeline",
            ("text_encoder", "text_encoder_2"),
            ("tokenizer", "tokenizer_2"),
            pooled=True,
            concept_layout="xl",
            kohya_te_numbered=True,
            lora_marks=(
                (r"^lora_te2_", "it adapts a second text encoder (text_encoder_2)"),
                (r"^lora_unet_up_blocks_0_attentions_", "it adapts attention in the UNet's first up block"),
            ),
            text_widths=(2048,),
            genai_text_adapters=False,
        ),
        # FLUX.1 (dev: guidance embedding; schnell: none): CLIP-L's pooled output and T5's hidden states condition a
        # 2x2-packed token transformer trained with rectified flow.
        FamilySpec(
            "flux",
            "FLUX.1",
            "FluxPipeline",
            "OVFluxPipeline",
            ("text_encoder", "text_encoder_2"),
            ("tokenizer", "tokenizer_2"),
            denoiser="transformer",
            denoiser_class="FluxTransformer2DModel",
            encoder_classes=("CLIPTextModel", "T5EncoderModel"),
            objective="flow",
            latent_multiple=2,
            max_sequence_length=512,
            kohya="bfl",
            kohya_te_numbered=True,
            lora_marks=(
                (
                    r"^lora_transformer_single_transformer_blocks_\d+_(attn_to_[qkv]|proj_mlp|proj_out|norm_linear)$",
                    "it adapts FLUX.1's single-stream transformer blocks",
                ),
            ),
            guidance_scale=3.5,
            negative_prompt_cfg=False,
        ),
        # SD3/SD3.5: CLIP-L and CLIP-G (hidden and pooled) beside T5's hidden states, an MMDiT over 2x2 patches.
        FamilySpec(
            "sd3",
            "SD3/SD3.5",
            "StableDiffusion3Pipeline",
            "OVStableDiffusion3Pipeline",
            ("text_encoder", "text_encoder_2", "text_encoder_3"),
            ("tokenizer", "tokenizer_2", "tokenizer_3"),
            pooled=True,
            denoiser="transformer",
            denoiser_class="SD3Transformer2DModel",
            encoder_classes=("CLIPTextModelWithProjection", "CLIPTextModelWithProjection", "T5EncoderModel"),
            objective="flow",
            latent_multiple=2,
            max_sequence_length=256,
            clip_context_tokens=77,
            kohya=None,
            lora_marks=((r"^lora_te2_", "it adapts a transformer and a second CLIP text encoder"),),
            genai_adapters=False,
            guidance_scale=7.0,
            weighting_scheme="logit_normal",
        ),
        # FLUX.2 [klein] (4B, 9B): one Qwen3 text encoder whose hidden states at three layers are stacked, a
        # FLUX.2 transformer over 2x2 patchified tokens of a 32-channel VAE (AutoencoderKLFlux2, batch-normalised
        # latents). FLUX.2 [dev] (a Mistral text encoder) is refused by its text encoder's class.
        FamilySpec(
            "flux2",
            "FLUX.2 [klein]",
            "Flux2KleinPipeline",
            "OVFlux2KleinPipeline",
            ("text_encoder",),
            ("tokenizer",),
            denoiser="transformer",
            denoiser_class="Flux2Transformer2DModel",
            encoder_classes=("Qwen3ForCausalLM",),
            vae_class="AutoencoderKLFlux2",
            objective="flow",
            latent_multiple=2,
            max_sequence_length=512,
            kohya=None,
            lora_marks=(
                (
                    r"^lora_transformer_single_transformer_blocks_\d+_attn_to_qkv_mlp_proj$",
                    "it adapts FLUX.2's fused single-stream projections",
                ),
            ),
            genai_edits=("image2image",),
            guidance_scale=4.0,
            resolution_shift=False,
        ),
        # Z-Image (6B): one Qwen3 text encoder, a single-stream transformer with its noise and context refiners.
        FamilySpec(
            "zimage",
            "Z-Image",
            "ZImagePipeline",
            "OVZImagePipeline",
            ("text_encoder",),
            ("tokenizer",),
            denoiser="transformer",
            denoiser_class="ZImageTransformer2DModel",
            encoder_classes=("Qwen3Model",),
            objective="flow",
            latent_multiple=2,
            max_sequence_length=512,
            kohya=None,
            lora_marks=(
                (
                    r"^lora_transformer_(noise_refiner|context_refiner|layers)_\d+_",
                    "it adapts Z-Image's refiner or single-stream layers",
                ),
            ),
            genai_adapters=False,  # GenAI 2026.4.1's Z-Image pipeline ignores adapters: no effect, no warning
            genai_edits=("image2image",),
            guidance_scale=5.0,
        ),
        # Qwen-Image (20B): Qwen2.5-VL's hidden states (the chat template's system prefix dropped), an MMDiT with
        # separate image and text MLPs, the Wan-style 16-channel VAE (AutoencoderKLQwenImage).
        FamilySpec(
            "qwenimage",
            "Qwen-Image",
            "QwenImagePipeline",
            "OVQwenImagePipeline",
            ("text_encoder",),
            ("tokenizer",),
            denoiser="transformer",
            denoiser_class="QwenImageTransformer2DModel",
            encoder_classes=("Qwen2_5_VLForConditionalGeneration",),
            vae_class="AutoencoderKLQwenImage",
            objective="flow",
            latent_multiple=2,
            max_sequence_length=512,
            kohya=None,
            lora_marks=(
                (
                    r"^lora_transformer_transformer_blocks_\d+_(img_mlp|txt_mlp|img_mod|txt_mod)_",
                    "it adapts Qwen-Image's image and text MLPs",
                ),
                # diffusers' default targets (attention only) share FLUX.1's, FLUX.2's and SD3's joint-block names:
                # only a block past SD3.5 Large's 38 (Qwen-Image has 60) tells them apart
                (
                    r"^lora_transformer_transformer_blocks_(3[89]|[4-9]\d)_",
                    "it adapts joint blocks past the 38 of the other MMDiTs (Qwen-Image has 60)",
                ),
            ),
            genai_edits=("image2image",),
            guidance_scale=4.0,
            negative_prompt_cfg=False,
            resolution_shift=False,
        ),
    )
}


def spec(name: str) -> FamilySpec:
    """The family called ``name`` (``sd``, ``sdxl``); FamilyError naming the known ones for another name."""
    try:
        return SPECS[name]
    except KeyError:
        raise FamilyError(f"unknown model family {name!r}; known: {', '.join(SPECS)}") from None


def run_spec(summary: dict[str, Any], run_dir: str) -> FamilySpec:
    """The family a run trained, from its ``train_summary.json`` (a run of an xeonsd older than the ``family``
    field was SD); a FamilyError names the run's summary and the family it does not know."""
    try:
        return spec(str(summary.get("family") or "sd"))
    except FamilyError as e:
        raise FamilyError(f"{run_dir}/train_summary.json: {e}") from None
