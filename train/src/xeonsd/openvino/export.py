"""``xeonsd export``: a Stable Diffusion pipeline (optionally with a learned concept) to OpenVINO, as the recipe did.

The recipe's steps, ``OVStableDiffusionPipeline.from_pretrained(model_id, export=True)``,
``reshape(batch_size=5, height=512, width=512, num_images_per_prompt=1)`` and ``save_pretrained``, plus:

* the concept: SRC is a full pipeline with the token(s) baked in (``--save_as_full_pipeline``), or a base model
  plus ``--embeds learned_embeds.safetensors``, added to tokenizer and text encoder before the export;
* a VAE decoder reshaped to the number of images a call produces. optimum-intel 2.2 reshapes it to
  ``num_images_per_prompt`` only, so ``reshape(batch_size=5, num_images_per_prompt=1)`` followed by 5 prompts
  fails in the decoder; here it gets ``batch_size * num_images_per_prompt``;
* ``--lora FILE --lora-scale S``: a LoRA adapter fused into the weights before the export (diffusers'
  ``load_lora_weights`` + ``fuse_lora``), for ``--engine optimum`` (no runtime LoRA) or one self-contained directory;
* ``--weight-format int8``: NNCF data-free 8-bit weight compression; ``fp16``: weights stored in half precision;
* ``--quantize hybrid``: NNCF hybrid int8, calibrated offline on our prompts (see :mod:`xeonsd.openvino.quantize`);
* the OpenVINO tokenizer model ``openvino_genai.Text2ImagePipeline`` needs (optimum-intel does not write one for
  diffusers pipelines), converted with ``openvino_tokenizers.convert_tokenizer``;
* the manifest ``xeonsd_export.json`` (see :mod:`xeonsd.openvino.manifest`).

Everything is written to a temporary directory beside OUT and renamed into place at the end.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from xeonsd.fsutil import atomic_dir
from xeonsd.modelsource import check_model_source
from xeonsd.openvino import tokenizer as ovtokenizer
from xeonsd.openvino.manifest import ExportDirError, StaticShape, check_writable_output, write_manifest
from xeonsd.openvino.quantize import DEFAULT_SAMPLES, QuantizeError, QuantizeOptions, check_options

log = logging.getLogger(__name__)

WEIGHT_FORMATS = ("fp32", "fp16", "int8")
# What a diffusers Stable Diffusion directory must hold for an export: (sub)folder -> accepted file names.
_PIPELINE_FILES: dict[str, tuple[str, ...]] = {
    "": ("model_index.json",),
    "unet": ("config.json",),
    "vae": ("config.json",),
    "text_encoder": ("config.json",),
    "tokenizer": ("tokenizer.json", "vocab.json"),
    "scheduler": ("scheduler_config.json",),
}
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


def check_source(src: str) -> Path | None:
    """A local SRC must be a complete diffusers pipeline; a Hub id must be one the Hub (or its cache) can serve."""
    path = Path(src)
    if not path.exists():
        check_model_source(src, flag="source")  # a Hub id the Hub or its cache can serve, or ModelSourceError
        return None
    if not path.is_dir():
        raise ExportError(f"source {src} is not a directory")
    if (path / "unet" / "openvino_model.xml").is_file():
        raise ExportError(f"source {src} is already an OpenVINO export; export needs the diffusers pipeline")
    for sub, names in _PIPELINE_FILES.items():
        folder = path / sub
        if not any((folder / n).is_file() for n in names):
            where = f"{sub}/" if sub else ""
            raise ExportError(
                f"source {src} is not a complete Stable Diffusion pipeline: {where}{' or '.join(names)} is missing"
            )
    for sub in ("unet", "vae", "text_encoder"):
        if not any(f.stat().st_size > 0 for g in _WEIGHT_GLOBS for f in (path / sub).glob(g)):
            raise ExportError(f"source {src} is not a complete Stable Diffusion pipeline: {sub}/ has no weights file")
    return path


def _with_concept(src: str, embeds: Path, token: str | None, workdir: Path) -> tuple[Path, list[str]]:
    """Write SRC with the concept added to tokenizer and text encoder into ``workdir``; return it and the tokens."""
    from diffusers import StableDiffusionPipeline

    from xeonsd.concept_file import add_to_torch, load_concept

    concept = load_concept(embeds, token)
    pipe = StableDiffusionPipeline.from_pretrained(src, safety_checker=None, requires_safety_checker=False)
    add_to_torch(pipe.tokenizer, pipe.text_encoder, concept)
    out = workdir / "pipeline"
    pipe.save_pretrained(out, safe_serialization=True)
    return out, concept.tokens


def _with_lora(src: str, lora: Path, scale: float, workdir: Path) -> Path:
    """Write SRC with the LoRA adapter fused into its UNet (and text encoder) into ``workdir``; return it."""
    from diffusers import StableDiffusionPipeline

    from xeonsd.openvino import lora_files as loraformat

    modules = loraformat.read_adapter(lora)
    pipe = StableDiffusionPipeline.from_pretrained(src, safety_checker=None, requires_safety_checker=False)
    weights = loraformat.torch_weight_shapes(pipe.unet, pipe.text_encoder)
    loraformat.check_fits(lora, modules, weights, f"the source {src}")
    log.info("fusing LoRA %s (scale %g, %d modules) into %s", lora, scale, len(modules), src)
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)  # a file path alone needs the Hub when offline
    pipe.fuse_lora(lora_scale=scale)
    pipe.unload_lora_weights()  # the fused weights stay; the adapter layers go
    # transformers 5 saves a text encoder that once held peft layers under other keys ("text_base_model.model.…"),
    # which load as missing (random) weights: save a fresh model holding the fused weights instead.
    te = pipe.text_encoder
    clean = type(te)(te.config)
    clean.load_state_dict(te.state_dict())
    pipe.register_modules(text_encoder=clean.eval())
    out = workdir / "pipeline-lora"
    pipe.save_pretrained(out, safe_serialization=True)
    return out


def _lora_manifest(src: str, opts: ExportOptions) -> dict[str, Any]:
    """The manifest's record of the base model and of a fused adapter."""
    from xeonsd.modelsource import model_fingerprint
    from xeonsd.openvino.manifest import _sha256

    lora = None
    if opts.lora is not None:
        lora = {"file": str(opts.lora), "scale": opts.lora_scale, "sha256": _sha256(Path(opts.lora))}
    return {"source_fingerprint": model_fingerprint(src), "lora": lora}


def reshape_static(pipe: Any, shape: StaticShape) -> None:
    """The recipe's ``reshape`` call, with the VAE decoder given the batch a call actually decodes."""
    pipe.reshape(
        batch_size=shape.batch_size,
        height=shape.height,
        width=shape.width,
        num_images_per_prompt=shape.num_images_per_prompt,
    )
    model = pipe.vae_decoder.model
    latent = model.inputs[0].get_partial_shape()
    latent[0] = shape.images_per_call
    model.reshape({model.inputs[0]: latent})
    pipe.clear_requests()


def export(src: str, out: Path, options: ExportOptions | None = None) -> Path:
    """Export SRC (a diffusers pipeline directory or Hub id) to the OpenVINO directory OUT; return OUT."""
    opts = options or ExportOptions()
    out = Path(out)
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
    local = check_source(src)
    if opts.embeds is not None and not Path(opts.embeds).is_file():
        raise ExportError(f"embeddings file {opts.embeds} does not exist")
    if opts.lora is not None and not Path(opts.lora).is_file():
        raise ExportError(f"LoRA file {opts.lora} does not exist")
    check_writable_output(out)
    if out.is_dir() and any(out.iterdir()) and not opts.overwrite:
        raise ExportError(f"output {out} already exists and is not empty; remove it or pass --overwrite")
    # The OpenVINO stack is imported only once the inputs are known to be good: a bad one fails at once.
    from optimum.intel import OVStableDiffusionPipeline, OVWeightQuantizationConfig

    from xeonsd.concept_file import ov_vocab_rows

    t0 = time.perf_counter()
    tokens: list[str] = []
    with tempfile.TemporaryDirectory(prefix="xeonsd-export-") as work:
        source: str = str(local) if local is not None else src
        if opts.embeds is not None:
            path, tokens = _with_concept(source, Path(opts.embeds), opts.token, Path(work))
            source = str(path)
        if opts.lora is not None:
            source = str(_with_lora(source, Path(opts.lora), opts.lora_scale, Path(work)))
        kwargs: dict[str, Any] = {"export": True, "compile": False}
        if opts.weight_format == "int8" and opts.quantize is None:  # hybrid compresses the weights itself
            kwargs["quantization_config"] = OVWeightQuantizationConfig(bits=8)  # data-free: no dataset
        log.info("exporting %s to OpenVINO (%s weights)", src, opts.weight_format)
        pipe = OVStableDiffusionPipeline.from_pretrained(source, **kwargs)
        if opts.weight_format == "fp16":
            pipe.half()
        if opts.static is not None:
            reshape_static(pipe, opts.static)
        rows = ov_vocab_rows(pipe.text_encoder.model)
        if rows != len(pipe.tokenizer):
            raise ExportError(f"text encoder has {rows} embedding rows but the tokenizer {len(pipe.tokenizer)} tokens")
        if not tokens:
            tokens = ovtokenizer.concept_tokens(pipe.tokenizer)
        quantization = None
        if opts.quantize is not None:
            from xeonsd.openvino.quantize import quantize_pipeline

            quantization = quantize_pipeline(pipe, opts.quantize, tokens, opts.static)
        with atomic_dir(out, overwrite=opts.overwrite) as tmp:
            pipe.save_pretrained(tmp)
            ovtokenizer.save(pipe.tokenizer, tmp)
            manifest = {
                "source": src,
                "embeds": None if opts.embeds is None else str(opts.embeds),
                "concept_tokens": tokens,
                "static_shape": None if opts.static is None else asdict(opts.static),
                "weight_format": opts.weight_format,
                "quantization": quantization,
                "vocab_size": rows,
                "export_seconds": round(time.perf_counter() - t0, 1),
                **_lora_manifest(src, opts),
            }
            write_manifest(tmp, manifest)
    log.info("wrote %s in %.1f s", out, time.perf_counter() - t0)
    return out


def quantize_options(args: Any) -> QuantizeOptions | None:
    """``--quantize`` and its calibration flags; the calibration flags alone are refused."""
    if args.quantize is None:
        if args.calibration_prompts is not None or args.calibration_samples is not None:
            raise ExportError("--calibration-prompts and --calibration-samples need --quantize hybrid")
        return None
    return QuantizeOptions(
        method=args.quantize,
        prompts_file=None if args.calibration_prompts is None else Path(args.calibration_prompts),
        samples=DEFAULT_SAMPLES if args.calibration_samples is None else args.calibration_samples,
    )


def _lora_args(args: Any) -> dict[str, Any]:
    return {"lora": None if args.lora is None else Path(args.lora), "lora_scale": args.lora_scale}


def main_args(args: Any, console: TextIO | None = None) -> int:
    """Entry point of ``xeonsd export`` (parsed by :mod:`xeonsd.cli`)."""
    static = (
        None
        if args.dynamic
        else StaticShape(
            batch_size=args.batch_size,
            height=args.height,
            width=args.width,
            num_images_per_prompt=args.num_images_per_prompt,
        )
    )
    quantize = quantize_options(args)
    opts = ExportOptions(
        static=static,
        weight_format=args.weight_format or ("int8" if quantize is not None else "fp32"),
        quantize=quantize,
        embeds=None if args.embeds is None else Path(args.embeds),
        token=args.token,
        overwrite=args.overwrite,
        **_lora_args(args),
    )
    out = export(args.src, Path(args.out), opts)
    print(json.dumps({"out": str(out), "static_shape": None if static is None else asdict(static)}), file=console)
    return 0


__all__ = ["ExportDirError", "ExportError", "ExportOptions", "export", "reshape_static", "check_source"]
