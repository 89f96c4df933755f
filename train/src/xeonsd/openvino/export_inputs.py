"""What ``xeonsd export`` checks before anything loads: the options, the source pipeline (complete, of a family we
serve) and the output, each refused in one line (:class:`ExportError`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from xeonsd.families import Family, detect_family
from xeonsd.modelfiles.modelsource import check_model_source
from xeonsd.openvino.manifest import StaticShape, check_writable_output
from xeonsd.openvino.quantize import QuantizeError, QuantizeOptions, check_options
from xeonsd.openvino.tome import TomeError, check_ratio

WEIGHT_FORMATS = ("fp32", "fp16", "int8")
# What a diffusers pipeline directory must hold for an export, besides its denoiser and text side (from the family's
# spec): (sub)folder -> accepted file names.
_PIPELINE_FILES: dict[str, tuple[str, ...]] = {
    "": ("model_index.json",),
    "vae": ("config.json",),
    "scheduler": ("scheduler_config.json",),
}
# A tokenizer folder holds one of these: CLIP's BPE files or a fast tokenizer (FLUX's and SD3's T5: tokenizer.json)
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "spiece.model")
_WEIGHT_GLOBS = ("*.safetensors", "*.bin")


class ExportError(ValueError):
    """The export cannot be done with these inputs."""


@dataclass(frozen=True)
class ExportOptions:
    """How to export. ``static`` None means ``--dynamic``; the default is the recipe's shape."""

    static: StaticShape | None = StaticShape(batch_size=5, height=512, width=512, num_images_per_prompt=1)
    weight_format: str = "fp32"
    embeds: Path | None = None
    token: str | None = None
    overwrite: bool = False
    quantize: QuantizeOptions | None = None  # hybrid int8 (needs weight_format "int8")
    lora: Path | None = None
    lora_scale: float = 1.0
    tome: float = 0.0  # token merging ratio (0: none; needs a static shape)
    tome_mlp: bool = False  # merge before the feed-forward too


def check_source(src: str) -> Path | None:
    """A local SRC must be a complete diffusers pipeline of a family we serve (its denoiser, VAE, every text encoder
    and tokenizer present); a Hub id must be one the Hub (or its cache) can serve."""
    path = Path(src)
    if not path.exists():
        check_model_source(src, flag="source")  # a Hub id the Hub or its cache can serve, or ModelSourceError
        return None
    if not path.is_dir():
        raise ExportError(f"source {src} is not a directory")
    if any((path / d / "openvino_model.xml").is_file() for d in ("unet", "transformer")):
        raise ExportError(f"source {src} is already an OpenVINO export; export needs the diffusers pipeline")
    if not (path / "model_index.json").is_file():
        raise ExportError(f"source {src} is not a complete diffusers pipeline: model_index.json is missing")
    found = detect_family(path).spec
    files = {**_PIPELINE_FILES, found.denoiser: ("config.json",)}
    files |= {encoder: ("config.json",) for encoder in found.text_encoders}
    files |= {tokenizer: _TOKENIZER_FILES for tokenizer in found.tokenizers}
    for sub, names in files.items():
        folder = path / sub
        if not any((folder / n).is_file() for n in names):
            where = f"{sub}/" if sub else ""
            raise ExportError(
                f"source {src} is not a complete {found.label} pipeline: {where}{' or '.join(names)} is missing"
            )
    for sub in (found.denoiser, "vae", *found.text_encoders):
        if not any(f.stat().st_size > 0 for g in _WEIGHT_GLOBS for f in (path / sub).glob(g)):
            raise ExportError(f"source {src} is not a complete {found.label} pipeline: {sub}/ has no weights file")
    return path


def check_export_options(opts: ExportOptions) -> None:
    """Refuse bad options before anything is loaded."""
    if opts.weight_format not in WEIGHT_FORMATS:
        raise ExportError(f"unknown weight format {opts.weight_format!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    if opts.static is not None:
        s = opts.static
        if min(s.batch_size, s.num_images_per_prompt) < 1 or s.height % 8 or s.width % 8 or min(s.height, s.width) < 8:
            raise ExportError(
                f"invalid static shape {s.describe()}: sizes must be positive, height/width multiples of 8"
            )
    if opts.quantize is not None:
        try:
            check_options(opts.quantize, opts.weight_format)
        except QuantizeError as exc:
            raise ExportError(str(exc)) from exc
    try:
        ratio = check_ratio(opts.tome)
    except TomeError as exc:
        raise ExportError(str(exc)) from exc
    if ratio > 0 and opts.static is None:
        raise ExportError("--tome needs a static export (its merge is fixed to the export's shape); drop --dynamic")


def check_inputs(src: str, out: Path, opts: ExportOptions) -> tuple[Path | None, Family]:
    """Every check of an export's inputs, in the order a user fixes them; the local source (None: a Hub id) and the
    family."""
    check_export_options(opts)
    local = check_source(src)
    family = detect_family(str(local) if local is not None else src)
    if not family.spec.ov_pipeline_class:
        raise ExportError(
            f"source {src} is {family.label} ({family.pipeline_class}), which optimum-intel has no OpenVINO export "
            "for; generate with its diffusers pipeline"
        )
    if opts.embeds is not None and not Path(opts.embeds).is_file():
        raise ExportError(f"embeddings file {opts.embeds} does not exist")
    if opts.quantize is not None and family.is_flow:
        raise ExportError(
            f"--quantize {opts.quantize.method}: {src} is {family.label}, and hybrid int8 calibrates a UNet's calls "
            "(not a transformer's yet); use --weight-format int8 (data-free int8 weights)"
        )
    if check_ratio(opts.tome) > 0 and family.is_flow:
        raise ExportError(
            f"--tome: {src} is {family.label}, and token merging patches a UNet's transformer blocks (not a "
            "transformer denoiser's joint attention yet); export without --tome"
        )
    if opts.embeds is not None and family.is_flow:
        raise ExportError(
            f"--embeds: {src} is {family.label}, and textual inversion is not served for it (no trainer trains it "
            "for these models); fine-tune a LoRA and export it with --lora"
        )
    if opts.lora is not None:  # a file, or a LoKr/LoHa run's directory: missing files fail before any model loads
        from xeonsd.openvino.adapter_fusion import adapter_kind

        adapter_kind(Path(opts.lora))
    check_writable_output(out, opts.overwrite)
    return local, family
