"""Which model family a pipeline belongs to, read from its small config files before any weight loads.

Every command that takes a model (``train``, ``export``, ``generate``, ``doctor``, ``bench``) asks
:func:`detect_family` and gets a :class:`Family`: what the pipeline's text side looks like (one text encoder, or
SDXL's two with the second's pooled output), its default resolution and its diffusers class. A family we do not
serve (PixArt, an SDXL refiner, an inpainting UNet, …) is refused in one line that names what was found and what is
supported, instead of a traceback after minutes of loading.

The rules read ``model_index.json`` (the pipeline's class and components), ``unet/config.json`` (``text_time``
conditioning, input channels, sample size) or ``transformer/config.json`` (the transformer families by its class,
FLUX.1-dev's guidance embedding; FLUX.2 [klein] and [dev] by the pipeline's class, each checked against the text
encoder's class in ``model_index.json``)
and ``vae/config.json`` (its scale factor), from a local directory or, for a Hub id, from the Hub (its cache when
offline): three small files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xeonsd.families.registry import REGISTRY
from xeonsd.families.spec import FamilyError, FamilySpec

SUPPORTED = ", ".join(f"{found.label} ({found.pipeline_class})" for found in REGISTRY)


def family_spec(family: Family | None) -> FamilySpec:
    """The spec of a detected family; SD 1.x/2.x's for models that were not read from a pipeline (built by hand)."""
    return family.spec if family is not None else REGISTRY[0]


@dataclass(frozen=True)
class Family:
    """A pipeline's family (:class:`FamilySpec`) with the sizes read from its config files."""

    spec: FamilySpec
    sample_size: int  # the denoiser's latent size at the model's resolution
    vae_scale: int  # pixels per latent
    guidance_embeds: bool = False  # FLUX.1-dev's guidance input (schnell has none)
    # the entries of model_index.json the spec names in ``pipeline_config`` (lists as tuples), as the pipeline's
    # constructor takes them
    pipeline_config: tuple[tuple[str, Any], ...] = ()

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


# The UNet families by their UNet's ``addition_embed_type`` (SDXL's "text_time"), the transformer families by their
# transformer's class (from the specs); every other transformer pipeline is refused by its class name.
UNET_FAMILIES = {s.addition_embed_type: s for s in REGISTRY if s.denoiser == "unet"}
TRANSFORMER_FAMILIES: dict[str, list[FamilySpec]] = {}
for _found in REGISTRY:
    if _found.denoiser == "transformer":
        TRANSFORMER_FAMILIES.setdefault(_found.denoiser_class, []).append(_found)
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
    found_spec = UNET_FAMILIES.get(unet.get("addition_embed_type"))
    extra = {c for c in have if c.startswith("text_encoder")} - set(found_spec.text_encoders if found_spec else ())
    if found_spec is None or extra:
        raise refuse(f"a UNet with addition_embed_type {unet.get('addition_embed_type')!r}")
    missing |= set(found_spec.text_encoders) | set(found_spec.tokenizers)
    missing -= have
    if missing:
        raise refuse(f"a {found_spec.label} pipeline without {', '.join(sorted(missing))}")
    check_pipeline(index, found_spec, refuse)
    return Family(found_spec, sample_size=int(unet.get("sample_size") or 64), vae_scale=vae_scale(vae))


def check_pipeline(index: dict[str, Any], found: FamilySpec, refuse) -> None:
    """The pipeline class of model_index.json against the ones ``found`` trains as: an edit model on the family's
    denoiser (Qwen-Image-Edit, FLUX.1 Kontext) would train as text-to-image without its reference images, so it is
    refused, naming what it is; a pipeline class no family knows is refused too. A model_index.json without a class
    (written by hand) is taken for the family its components say."""
    cls = index.get("_class_name")
    if cls is None or cls in found.pipelines:
        return
    # the variants of every family on this denoiser (FLUX.1 Kontext's inpainting, on FLUX.1's transformer)
    what = next(
        (
            dict(f.variants)[cls]
            for f in REGISTRY
            if f.denoiser_class == found.denoiser_class and cls in dict(f.variants)
        ),
        None,
    )
    if what is not None:
        raise refuse(f"{what}, on {found.label}'s {found.denoiser}; it is not trained here")
    raise refuse(f"a {cls} on {found.label}'s {found.denoiser}: {found.label} trains as {', '.join(found.pipelines)}")


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
    """The transformer family from the transformer's class, and the pipeline's class where several families share
    it (FLUX.1 and FLUX.1 Kontext, FLUX.2 [klein] and [dev]); checked against the text encoder the pipeline declares
    where one class serves several models ([dev]'s Mistral3 against [klein]'s Qwen3); FLUX.1-dev from its guidance
    embedding."""
    cls = str(transformer.get("_class_name") or (index.get("transformer") or [None, "?"])[1])
    candidates = TRANSFORMER_FAMILIES.get(cls)
    if candidates is None:
        what = _NOT_SERVED.get(cls, cls)
        raise refuse(f"a transformer pipeline of {what} ({cls})")
    # families on one transformer class (FLUX.1 and FLUX.1 Kontext) are told apart by the pipeline's class
    found_spec = next((c for c in candidates if index.get("_class_name") in c.pipelines), candidates[0])
    needed = {"vae", "scheduler", *found_spec.text_encoders, *found_spec.tokenizers}
    missing = (needed | ({found_spec.processor} if found_spec.processor else set())) - have
    if missing:
        raise refuse(f"a {found_spec.label} pipeline without {', '.join(sorted(missing))}")
    for name, expected in zip(found_spec.text_encoders, found_spec.encoder_classes, strict=False):
        declared = (index.get(name) or [None, None])[1]
        # a decoder LLM as text encoder names the model (CLIP and T5 classes are shared by many)
        if not expected.startswith(("CLIP", "T5")) and declared != expected:
            raise refuse(f"a {cls} pipeline whose {name} is {declared}, not {found_spec.label}'s {expected}")
    check_pipeline(index, found_spec, refuse)
    scale = vae_scale(vae)
    # SD3's transformer config gives its latent size (128: 1024 px); FLUX's has none, its VAE's gives the pixels
    pixels = int((vae or {}).get("sample_size") or 1024)
    sample = int(transformer.get("sample_size") or pixels // scale)
    settings = tuple(
        (key, tuple(value) if isinstance(value, list) else value)
        for key, value in ((k, index[k]) for k in found_spec.pipeline_config if k in index)
    )
    return Family(
        found_spec, sample, scale, guidance_embeds=bool(transformer.get("guidance_embeds")), pipeline_config=settings
    )


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


def denoiser_config(src: str | Path, spec: FamilySpec, revision: str | None = None) -> dict[str, Any]:
    """The denoiser's config of a pipeline of ``spec``'s family (its ``config.json`` less the ``_`` entries: its
    architecture), read as detection reads it."""
    config = _read(src, f"{spec.denoiser}/config.json", revision, required=True) or {}
    return {k: v for k, v in config.items() if not k.startswith("_")}


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
