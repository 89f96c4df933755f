"""Which model family a pipeline belongs to, read from its small config files before any weight loads.

Every command that takes a model (``train``, ``export``, ``generate``, ``doctor``, ``bench``) asks
:func:`detect_family` and gets a :class:`Family`: what the pipeline's text side looks like (one text encoder, or
SDXL's two with the second's pooled output), its default resolution and its diffusers class. A family we do not
serve (FLUX.2 [dev], PixArt, an SDXL refiner, an inpainting UNet, …) is refused in one line that names what was found and what
is supported, instead of a traceback after minutes of loading.

The rules read ``model_index.json`` (the pipeline's class and components), ``unet/config.json`` (``text_time``
conditioning, input channels, sample size) or ``transformer/config.json`` (the transformer families by its class,
FLUX.1-dev's guidance embedding; FLUX.2 [klein] against [dev] by the text encoder's class in ``model_index.json``)
and ``vae/config.json`` (its scale factor), from a local directory or, for a Hub id, from the Hub (its cache when
offline): three small files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xeonsd.modelfiles.family_specs import SPECS, FamilyError, FamilySpec, spec, tokenizer_limit

__all__ = [
    "SPECS",
    "Family",
    "FamilyError",
    "FamilySpec",
    "detect_family",
    "family_of",
    "family_spec",
    "spec",
    "tokenizer_limit",
    "vae_scale",
]

SUPPORTED = (
    "SD 1.x/2.x (StableDiffusionPipeline), SDXL base (StableDiffusionXLPipeline), FLUX.1 dev/schnell (FluxPipeline), "
    "SD3/SD3.5 (StableDiffusion3Pipeline), FLUX.2 [klein] (Flux2KleinPipeline), Z-Image (ZImagePipeline) and "
    "Qwen-Image (QwenImagePipeline)"
)


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


# The transformer classes we train, by family (from the specs); every other transformer pipeline is refused by its
# class name.
TRANSFORMER_FAMILIES = {s.denoiser_class: s.name for s in SPECS.values() if s.denoiser == "transformer"}
# Transformer classes users ask about, with why they are refused.
_NOT_SERVED = {"PixArtTransformer2DModel": "PixArt", "SanaTransformer2DModel": "Sana"}


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
    return Family(found_spec, sample_size=int(unet.get("sample_size") or 64), vae_scale=vae_scale(vae))


def vae_scale(vae: Any) -> int:
    """Pixels per latent of a VAE config (a dict, or an object with attributes): 2 per downsampling block
    (``block_out_channels``; Qwen-Image's Wan-style VAE: ``temperal_downsample``, one entry per downsampling
    stage)."""
    vae = vae or {}
    get = vae.get if isinstance(vae, dict) else lambda key: getattr(vae, key, None)
    blocks, temporal = get("block_out_channels"), get("temperal_downsample")
    if not blocks and temporal:
        return 2 ** len(temporal)
    return 2 ** (len(blocks or [0, 0, 0, 0]) - 1)


def _transformer_family(index, transformer: dict[str, Any], vae, have: set[str], refuse) -> Family:
    """The transformer family from the transformer's class, checked against the text encoder the pipeline declares
    where one class serves several models (FLUX.2 [dev]'s Mistral against [klein]'s Qwen3); FLUX.1-dev from its
    guidance embedding."""
    cls = str(transformer.get("_class_name") or (index.get("transformer") or [None, "?"])[1])
    name = TRANSFORMER_FAMILIES.get(cls)
    if name is None:
        what = _NOT_SERVED.get(cls, cls)
        raise refuse(f"a transformer pipeline of {what} ({cls})")
    found_spec = SPECS[name]
    missing = ({"vae", "scheduler"} | set(found_spec.text_encoders) | set(found_spec.tokenizers)) - have
    if missing:
        raise refuse(f"a {found_spec.label} pipeline without {', '.join(sorted(missing))}")
    for name, expected in zip(found_spec.text_encoders, found_spec.encoder_classes, strict=False):
        declared = (index.get(name) or [None, None])[1]
        # a decoder LLM as text encoder names the model (CLIP and T5 classes are shared by many)
        if not expected.startswith(("CLIP", "T5")) and declared != expected:
            raise refuse(f"a {cls} pipeline whose {name} is {declared}, not {found_spec.label}'s {expected}")
    scale = vae_scale(vae)
    # SD3's transformer config gives its latent size (128: 1024 px); FLUX's has none, its VAE's gives the pixels
    pixels = int((vae or {}).get("sample_size") or 1024)
    sample = int(transformer.get("sample_size") or pixels // scale)
    return Family(found_spec, sample, scale, guidance_embeds=bool(transformer.get("guidance_embeds")))


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
