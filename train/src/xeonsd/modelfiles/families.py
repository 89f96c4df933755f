"""Which model family a pipeline belongs to, read from its small config files before any weight loads.

Every command that takes a model (``train``, ``export``, ``generate``, ``doctor``, ``bench``) asks
:func:`detect_family` and gets a :class:`Family`: what the pipeline's text side looks like (one text encoder, or
SDXL's two with the second's pooled output), its default resolution and its diffusers class. A family we do not
serve (FLUX.2, PixArt, an SDXL refiner, an inpainting UNet, …) is refused in one line that names what was found and what
is supported, instead of a traceback after minutes of loading.

The rules read ``model_index.json`` (the pipeline's class and components), ``unet/config.json`` (``text_time``
conditioning, input channels, sample size) or ``transformer/config.json`` (FLUX.1 or SD3 by its class, FLUX.1-dev's
guidance embedding) and ``vae/config.json`` (its scale factor), from a local directory or, for a Hub id, from the
Hub (its cache when offline): three small files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED = (
    "SD 1.x/2.x (StableDiffusionPipeline), SDXL base (StableDiffusionXLPipeline), FLUX.1 dev/schnell (FluxPipeline) "
    "and SD3/SD3.5 (StableDiffusion3Pipeline)"
)


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
    # the denoiser's component name and diffusers class
    denoiser: str = "unet"
    denoiser_class: str = "UNet2DConditionModel"
    # the transformers class of each text encoder, in ``text_encoders`` order; empty: CLIP (see text_encoder_class)
    encoder_classes: tuple[str, ...] = ()
    # the training objective: "noise" (epsilon/v-prediction on a DDPM schedule) or "flow" (rectified flow)
    objective: str = "noise"
    # latent side lengths must be a multiple of this (FLUX packs 2x2 latents into one token)
    latent_multiple: int = 1
    # diffusers' default T5 prompt length of the family's pipeline (FluxPipeline 512, StableDiffusion3Pipeline 256);
    # None: no T5 (see t5_length)
    t5_length: int | None = None

    def t5_prompt_length(self, tokenizer_limit: float | None) -> int | None:
        """T5's prompt length: the pipeline's default, or the T5 tokenizer's ``model_max_length`` where that is
        shorter (the tiny models' 32); None for the CLIP-only families. The trainer's tables, the memory estimate,
        the export (which fixes it in a static export) and every engine use this one rule."""
        if self.t5_length is None:
            return None
        return self.t5_length if tokenizer_limit is None else min(self.t5_length, int(tokenizer_limit))

    def t5_prompt_length_of(self, src: str | Path) -> int | None:
        """:meth:`t5_prompt_length` with the limit read from the pipeline directory's T5 tokenizer config (the
        default where there is no such file: a Hub id, or a config without a limit)."""
        limit = None if self.t5_length is None else tokenizer_limit(src, self.tokenizers[-1])
        return self.t5_prompt_length(limit)

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
        ),
        FamilySpec(
            "sdxl",
            "SDXL",
            "StableDiffusionXLPipeline",
            "OVStableDiffusionXLPipeline",
            ("text_encoder", "text_encoder_2"),
            ("tokenizer", "tokenizer_2"),
            pooled=True,
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
            t5_length=512,
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
            t5_length=256,
        ),
    )
}


def spec(name: str) -> FamilySpec:
    """The family called ``name`` (``sd``, ``sdxl``); FamilyError naming the known ones for another name."""
    try:
        return SPECS[name]
    except KeyError:
        raise FamilyError(f"unknown model family {name!r}; known: {', '.join(SPECS)}") from None


def family_spec(family: Family | None) -> FamilySpec:
    """The spec of a detected family; SD 1.x/2.x's for models that were not read from a pipeline (built by hand)."""
    return family.spec if family is not None else SPECS["sd"]


@dataclass(frozen=True)
class Family:
    """A pipeline's family (:class:`FamilySpec`) with the sizes read from its config files."""

    spec: FamilySpec
    sample_size: int  # the denoiser's latent size at the model's resolution
    vae_scale: int  # pixels per latent
    guidance_embeds: bool = False  # FLUX.1-dev's guidance input (schnell has none)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def pipeline_class(self) -> str:
        return self.spec.pipeline_class

    @property
    def text_encoders(self) -> tuple[str, ...]:
        return self.spec.text_encoders

    @property
    def tokenizers(self) -> tuple[str, ...]:
        return self.spec.tokenizers

    @property
    def default_resolution(self) -> int:
        """The resolution the model was trained at: 512 (SD 1.5), 768 (SD 2.1 768-v), 1024 (SDXL)."""
        return self.sample_size * self.vae_scale

    @property
    def is_xl(self) -> bool:
        return self.name == "sdxl"

    @property
    def is_flow(self) -> bool:
        """Trained with rectified flow on a transformer (FLUX.1, SD3)."""
        return self.spec.objective == "flow"

    @property
    def pixel_multiple(self) -> int:
        """Image sides must be a multiple of this: the VAE's scale times the latent packing (FLUX: 16)."""
        return self.vae_scale * self.spec.latent_multiple


def components(index: dict[str, Any]) -> set[str]:
    """The pipeline components that are present (``[library, class]`` entries that are not ``[null, null]``)."""
    return {
        k
        for k, v in index.items()
        if not k.startswith("_") and isinstance(v, list) and len(v) == 2 and v[0] is not None and v[1] is not None
    }


# The transformer classes we train, by family; every other transformer pipeline is refused by its class name.
TRANSFORMER_FAMILIES = {"FluxTransformer2DModel": "flux", "SD3Transformer2DModel": "sd3"}
# Transformer classes users ask about, with why they are refused.
_NOT_SERVED = {
    "Flux2Transformer2DModel": "FLUX.2 (its Qwen3 text encoder and 32-channel VAE are not supported yet)",
    "PixArtTransformer2DModel": "PixArt",
    "SanaTransformer2DModel": "Sana",
}


def family_of(
    index: dict[str, Any],
    unet: dict[str, Any] | None,
    vae: dict[str, Any] | None,
    where: str,
    transformer: dict[str, Any] | None = None,
) -> Family:
    """The family of a pipeline from its config files (pure: the rules, without the reading)."""
    cls = str(index.get("_class_name", "an unnamed pipeline"))
    have = components(index)
    found = f"{cls} with {', '.join(sorted(have)) or 'no components'}"

    def refuse(what: str) -> FamilyError:
        return FamilyError(f"{where}: {what} ({found}); supported: {SUPPORTED}")

    if "transformer" in have:
        return _transformer_family(index, transformer or {}, vae, have, refuse)
    if unet is None:
        raise refuse("neither a UNet nor a transformer pipeline")
    if index.get("requires_aesthetics_score") or ("text_encoder_2" in have and "text_encoder" not in have):
        raise refuse("an SDXL refiner (it refines SDXL base images and is not fine-tuned on its own)")
    if unet.get("in_channels", 4) != 4:
        raise refuse(f"a UNet with {unet.get('in_channels')} input channels (inpainting or depth models)")
    missing = {"vae", "scheduler"} - have
    text_time = unet.get("addition_embed_type") == "text_time"
    if text_time:
        found_spec = SPECS["sdxl"]
    elif unet.get("addition_embed_type") is None and "text_encoder_2" not in have:
        found_spec = SPECS["sd"]
    else:
        raise refuse(f"a UNet with addition_embed_type {unet.get('addition_embed_type')!r}")
    missing |= set(found_spec.text_encoders) | set(found_spec.tokenizers)
    missing -= have
    if missing:
        raise refuse(f"a {found_spec.label} pipeline without {', '.join(sorted(missing))}")
    blocks = (vae or {}).get("block_out_channels") or [0, 0, 0, 0]
    return Family(found_spec, sample_size=int(unet.get("sample_size") or 64), vae_scale=2 ** (len(blocks) - 1))


def _transformer_family(index, transformer: dict[str, Any], vae, have: set[str], refuse) -> Family:
    """FLUX.1 or SD3 from the transformer's class (and FLUX.1-dev from its guidance embedding)."""
    cls = str(transformer.get("_class_name") or (index.get("transformer") or [None, "?"])[1])
    name = TRANSFORMER_FAMILIES.get(cls)
    if name is None:
        what = _NOT_SERVED.get(cls, cls)
        raise refuse(f"a transformer pipeline of {what} ({cls})")
    found_spec = SPECS[name]
    missing = ({"vae", "scheduler"} | set(found_spec.text_encoders) | set(found_spec.tokenizers)) - have
    if missing:
        raise refuse(f"a {found_spec.label} pipeline without {', '.join(sorted(missing))}")
    blocks = (vae or {}).get("block_out_channels") or [0, 0, 0, 0]
    vae_scale = 2 ** (len(blocks) - 1)
    # SD3's transformer config gives its latent size (128: 1024 px); FLUX's has none, its VAE's gives the pixels
    pixels = int((vae or {}).get("sample_size") or 1024)
    sample = int(transformer.get("sample_size") or pixels // vae_scale)
    return Family(found_spec, sample, vae_scale, guidance_embeds=bool(transformer.get("guidance_embeds")))


def detect_family(src: str | Path, revision: str | None = None) -> Family:
    """The family of the pipeline at ``src`` (a local pipeline directory or a Hub id)."""
    where = str(src)
    index = _read(src, "model_index.json", revision, required=True)
    assert index is not None
    have = components(index)
    unet = _read(src, "unet/config.json", revision, required="unet" in have)
    vae = _read(src, "vae/config.json", revision, required="vae" in have)
    transformer = _read(src, "transformer/config.json", revision, required="transformer" in have)
    return family_of(index, unet, vae, where, transformer)


def _read(src: str | Path, name: str, revision: str | None, required: bool) -> dict[str, Any] | None:
    if not required:
        return None
    local = Path(src)
    try:
        if local.is_dir():
            text = (local / name).read_text()
        else:
            from huggingface_hub import hf_hub_download

            text = Path(hf_hub_download(str(src), name, revision=revision)).read_text()
        data = json.loads(text)
    except (OSError, ValueError) as exc:  # missing file, offline without a cache, not JSON
        raise FamilyError(f"{src}: cannot read {name} to tell the model family: {exc}") from exc
    if not isinstance(data, dict):
        raise FamilyError(f"{src}: {name} is not a JSON object")
    return data
