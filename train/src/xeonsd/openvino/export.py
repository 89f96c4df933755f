"""``xeonsd export``: a Stable Diffusion pipeline (optionally with a learned concept) to OpenVINO, as the recipe did.

The recipe's steps, ``OVStableDiffusionPipeline.from_pretrained(model_id, export=True)``,
``reshape(batch_size=5, height=512, width=512, num_images_per_prompt=1)`` and ``save_pretrained``, plus:

* the family, read from SRC's config files (:func:`xeonsd.families.detect_family`): SD 1.x/2.x through
  ``OVStableDiffusionPipeline``, SDXL through ``OVStableDiffusionXLPipeline`` (both text encoders, both tokenizers;
  see :mod:`xeonsd.openvino.pipelines`); the CLI's default size is the family's resolution (SDXL 1024);
* the concept: SRC is a full pipeline with the token(s) baked in (``--save_as_full_pipeline``), or a base model
  plus ``--embeds learned_embeds.safetensors``, added to tokenizer and text encoder before the export;
* a VAE decoder reshaped to the number of images a call produces. optimum-intel 2.2 reshapes it to
  ``num_images_per_prompt`` only, so ``reshape(batch_size=5, num_images_per_prompt=1)`` followed by 5 prompts
  fails in the decoder; here it gets ``batch_size * num_images_per_prompt``;
* ``--lora FILE --lora-scale S``: a LoRA or DoRA adapter fused into the weights before the export (diffusers'
  ``load_lora_weights`` + ``fuse_lora``), for ``--engine optimum`` (no runtime LoRA) or one self-contained directory;
  a LoKr or LoHa run (peft's layout: FILE its ``adapter_model.safetensors`` or directory) merged by peft, see
  :mod:`xeonsd.openvino.adapter_fusion` (GenAI applies plain LoRA only: these reach OpenVINO this way alone);
* ``--weight-format int8``: NNCF data-free 8-bit weight compression; ``fp16``: weights stored in half precision;
* ``--quantize hybrid|hybrid-compact``: NNCF int8, calibrated offline on our prompts (see :mod:`xeonsd.openvino.quantize`);
* the OpenVINO tokenizer model ``openvino_genai.Text2ImagePipeline`` needs (optimum-intel does not write one for
  diffusers pipelines), converted with ``openvino_tokenizers.convert_tokenizer``;
* the manifest ``xeonsd_export.json`` (see :mod:`xeonsd.openvino.manifest`).

Everything is written to a temporary directory beside OUT and renamed into place at the end.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, TextIO

from xeonsd.families import Family, detect_family
from xeonsd.flags import from_args
from xeonsd.fsutil import atomic_dir
from xeonsd.openvino import pipelines
from xeonsd.openvino import tokenizer as ovtokenizer
from xeonsd.openvino.export_args import ExportRequest
from xeonsd.openvino.export_inputs import ExportError, ExportOptions, check_inputs, check_source
from xeonsd.openvino.manifest import ExportDirError, StaticShape, write_manifest
from xeonsd.openvino.quantize import DEFAULT_SAMPLES, METHODS, QuantizeOptions
from xeonsd.openvino.tome import TomeReport, check_ratio, export_patch

log = logging.getLogger(__name__)


def _with_concept(src: str, embeds: Path, token: str | None, workdir: Path, family: Family) -> tuple[Path, list[str]]:
    """Write SRC with the concept added to its tokenizer(s) and text encoder(s) into ``workdir``; return it and the
    tokens."""
    from xeonsd.modelfiles.concept_file import load_concepts

    concepts = load_concepts(embeds, token, family.spec)
    pipe = pipelines.load_torch_pipeline(src, family.spec)
    tokens = pipelines.add_concepts_to_torch(pipe, family.spec, concepts)
    out = workdir / "pipeline"
    pipe.save_pretrained(out, safe_serialization=True)
    return out, tokens


def _with_lora(src: str, lora: Path, scale: float, workdir: Path, family: Family) -> Path:
    """Write SRC with the adapter fused into its denoiser (and CLIP text encoders) into ``workdir``; return it.
    A LoRA or DoRA file goes through diffusers (``load_lora_weights`` + ``fuse_lora``); a kohya file, and every plain
    LoRA of a transformer family, as our diffusers-layout copy (exact; diffusers' own FLUX kohya reader assumes
    FLUX.1's widths). A LoKr or LoHa run (peft's layout) is merged by peft (:mod:`xeonsd.openvino.adapter_fusion`)."""
    from xeonsd.modelfiles import lora_layout
    from xeonsd.openvino import adapter_fusion

    adapter = adapter_fusion.adapter_kind(lora)
    model = f"the source {src}"
    if adapter.peft:
        pipe = pipelines.load_torch_pipeline(src, family.spec)
        count = adapter_fusion.fuse_peft(pipe, family.spec, adapter.path, scale, model)
        log.info("fused %s %s (scale %g, %d modules) into %s", adapter.kind, adapter.path, scale, count, src)
        return _save(pipe, workdir / "pipeline-lora")
    modules = lora_layout.read_adapter(lora, dora=adapter.kind == "dora")
    lora_layout.check_family(lora, modules, family.spec, model)
    pipe = pipelines.load_torch_pipeline(src, family.spec)
    parts = pipelines.lora_parts(pipe, family.spec)
    weights = lora_layout.torch_weight_shapes(**parts)
    lora_layout.check_fits(lora, modules, weights, model)
    log.info("fusing %s %s (scale %g, %d modules) into %s", adapter.kind, lora, scale, len(modules), src)
    # DoRA's magnitudes are read by diffusers only: its file (always diffusers' layout) goes as it is
    if adapter.kind == "lora" and (family.is_flow or any(m.module is None for m in modules.values())):
        names = lora_layout.module_names(**parts)
        lora = lora_layout.write_diffusers(modules, workdir / "lora" / lora.name, names, lora)
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)  # a file path alone needs the Hub when offline
    # FluxPipeline.fuse_lora fuses only the transformer unless told (diffusers 0.39): name every adapted part
    pipe.fuse_lora(lora_scale=scale, components=pipelines.lora_components(pipe, family.spec))
    pipelines.unload_fused_lora(pipe, family.spec)  # the fused weights stay; the adapter layers go
    pipelines.fresh_text_encoders(pipe, family.spec)
    return _save(pipe, workdir / "pipeline-lora")


def _save(pipe: Any, out: Path) -> Path:
    pipe.save_pretrained(out, safe_serialization=True)
    return out


def _lora_manifest(src: str, opts: ExportOptions) -> dict[str, Any]:
    """The manifest's record of the base model and of a fused adapter."""
    from xeonsd.modelfiles.modelsource import model_fingerprint
    from xeonsd.openvino.manifest import _sha256

    lora = None
    if opts.lora is not None:  # a LoKr/LoHa run's directory: its weights file
        from xeonsd.openvino.adapter_fusion import adapter_kind

        path = adapter_kind(Path(opts.lora)).path
        lora = {"file": str(path), "scale": opts.lora_scale, "sha256": _sha256(path)}
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


def _latent_size(source: str, shape: StaticShape) -> tuple[int, int]:
    """The UNet's sample size (h, w) for images of ``shape``: the VAE downsamples by 2 per block after the first."""
    from diffusers import AutoencoderKL

    blocks = len(AutoencoderKL.load_config(source, subfolder="vae")["block_out_channels"])
    factor = 2 ** (blocks - 1)
    return shape.height // factor, shape.width // factor


def export(src: str, out: Path, options: ExportOptions | None = None) -> Path:
    """Export SRC (a diffusers pipeline directory or Hub id) to the OpenVINO directory OUT; return OUT."""
    opts = options or ExportOptions()
    out = Path(out)
    local, family = check_inputs(src, out, opts)
    # The OpenVINO stack is imported only once the inputs are known to be good: a bad one fails at once.
    from optimum.intel import OVWeightQuantizationConfig

    t0 = time.perf_counter()
    tokens: list[str] = []
    with _libraries_frozen(), tempfile.TemporaryDirectory(prefix="xeonsd-export-") as work:
        source: str = str(local) if local is not None else src
        if opts.embeds is not None:
            path, tokens = _with_concept(source, Path(opts.embeds), opts.token, Path(work), family)
            source = str(path)
        if opts.lora is not None:
            source = str(_with_lora(source, Path(opts.lora), opts.lora_scale, Path(work), family))
        # load_in_8bit=False: unasked, optimum compresses every submodel of 1 B parameters or more to int8 weights
        # (SDXL's 2.6 B UNet: an "fp32" export would be an int8 one, and hybrid would quantize it twice).
        kwargs: dict[str, Any] = {"export": True, "compile": False, "load_in_8bit": False}
        if opts.weight_format == "int8" and opts.quantize is None:  # hybrid compresses the weights itself
            kwargs["quantization_config"] = OVWeightQuantizationConfig(bits=8)  # data-free: no dataset
        log.info("exporting %s (%s) to OpenVINO (%s weights)", src, family.label, opts.weight_format)
        merging = (
            contextlib.nullcontext(TomeReport(ratio=0.0, mlp=False))
            if opts.tome == 0
            else export_patch(opts.tome, opts.tome_mlp, _latent_size(source, opts.static))  # type: ignore[arg-type]
        )
        with merging as tome:
            pipe = pipelines.ov_pipeline_class(family.spec).from_pretrained(source, **kwargs)
        if opts.weight_format == "fp16":
            pipe.half()
        if opts.static is not None:
            reshape_static(pipe, opts.static)
            pipelines.reshape_text_length(pipe, family.spec, pipelines.max_sequence_length(pipe, family.spec))
        rows = _check_vocab(pipe, family)
        if not tokens:
            tokens = ovtokenizer.concept_tokens(pipe.tokenizer)
        quantization = None
        if opts.quantize is not None:
            from xeonsd.openvino.quantize import quantize_pipeline

            quantization = quantize_pipeline(pipe, opts.quantize, tokens, opts.static)
        if family.spec.denoiser == "transformer":  # GenAI's LoRA pass needs it (see split_free_matmul_inputs)
            pipelines.split_free_matmul_inputs(pipe.transformer.model)
        with atomic_dir(out, overwrite=opts.overwrite) as tmp:
            save_networks(pipe, Path(tmp), out)
            for _, tokenizer in family.spec.text_side:
                ovtokenizer.save(getattr(pipe, tokenizer), tmp, tokenizer)
            manifest = {
                "source": src,
                "family": family.name,
                "default_resolution": family.default_resolution,  # a dynamic export's size when none is asked
                "embeds": None if opts.embeds is None else str(opts.embeds),
                "concept_tokens": tokens,
                "static_shape": None if opts.static is None else asdict(opts.static),
                "weight_format": opts.weight_format,
                "quantization": quantization,
                "tome": tome.manifest_entry() if tome.blocks else None,
                "vocab_size": rows,
                "max_sequence_length": pipelines.max_sequence_length(pipe, family.spec),
                "export_seconds": round(time.perf_counter() - t0, 1),
                **_lora_manifest(src, opts),
            }
            write_manifest(tmp, manifest)
    log.info("wrote %s in %.1f s", out, time.perf_counter() - t0)
    return out


@contextlib.contextmanager
def _libraries_frozen() -> Iterator[None]:
    """While the export runs, keep what the imports made out of the garbage collector's sight.

    optimum's exporter calls ``gc.collect()`` after every network it converts (13 times for an SD 1.5 pipeline),
    and each full collection walks every object of torch, transformers, diffusers and OpenVINO: 0.27 s each, a
    third of the tiny model's export (9.1 s -> 5.8-6.2 s measured, interleaved). ``gc.freeze()`` moves the
    objects that exist now (the libraries' modules, classes and functions) to a permanent generation, so those
    collections walk only what the export makes; ``gc.unfreeze()`` at the end gives them back, so a process that
    exports several times (``bench generate``) keeps no object out of the collector's reach for good.
    """
    import optimum.exporters.openvino.convert  # noqa: F401 - the exporter's own imports, before the freeze
    import optimum.intel.openvino.modeling_diffusion  # noqa: F401

    gc.collect()  # garbage from the imports is freed, not frozen
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# Below this much free space, a failed save is taken for a full disk (OpenVINO then says only "iostream error").
DISK_FULL_BYTES = 2 * 1024**3


def save_networks(pipe: Any, tmp: Path, out: Path) -> None:
    """``pipe.save_pretrained(tmp)``; a failure on a (nearly) full disk becomes an ExportError naming the free
    space where the export is written and where optimum keeps the converted networks until then (the temporary
    directory): an export needs room for its networks twice."""
    try:
        pipe.save_pretrained(tmp)
    except (RuntimeError, OSError) as exc:
        places = {str(out.parent.resolve()): tmp, tempfile.gettempdir(): Path(tempfile.gettempdir())}
        free = {where: shutil.disk_usage(path).free for where, path in places.items()}
        if min(free.values()) >= DISK_FULL_BYTES:
            raise
        said = ", ".join(f"{b / 1024**3:.1f} GB free in {where}" for where, b in free.items())
        raise ExportError(
            f"cannot write the OpenVINO model to {out}: the disk is full ({said}; OpenVINO said: {exc}). The "
            "export holds its converted networks in the temporary directory while it writes them to the output, "
            "so it needs their size free twice (an fp32 SDXL: about 14 GB each), and with --embeds or --lora a "
            "copy of the source pipeline too. Free some space, or point TMPDIR at a file system with room."
        ) from exc


def _check_vocab(pipe: Any, family: Family) -> int | None:
    """Every exported CLIP text encoder has one embedding row per token of its tokenizer; returns the first's rows,
    None for a family without CLIP (the Qwen-text ones). (T5's and Qwen's tables are padded past their vocabulary,
    T5's 32128 rows for 32100 tokens, and take no concept.)"""
    from xeonsd.modelfiles.concept_file import ov_vocab_rows

    counts = []
    for i, (encoder, tokenizer) in enumerate(family.spec.text_side):
        if not family.spec.text_encoder_class(i).startswith("CLIP"):
            continue
        rows, tokens = ov_vocab_rows(getattr(pipe, encoder).model), len(getattr(pipe, tokenizer))
        if rows != tokens:
            raise ExportError(f"{encoder} has {rows} embedding rows but {tokenizer} {tokens} tokens")
        counts.append(rows)
    return counts[0] if counts else None


def default_size(src: str) -> int:
    """The side of the CLI's default static shape: the family's resolution (SD 1.5 512, SDXL 1024)."""
    local = check_source(src)
    return detect_family(str(local) if local is not None else src).default_resolution


def quantize_options(args: Any) -> QuantizeOptions | None:
    """``--quantize`` and its calibration flags (an :class:`ExportRequest` or its parsed namespace); the calibration
    flags alone are refused."""
    if args.quantize is None:
        if args.calibration_prompts is not None or args.calibration_samples is not None:
            methods = " or ".join(METHODS)
            raise ExportError(f"--calibration-prompts and --calibration-samples need --quantize ({methods})")
        return None
    return QuantizeOptions(
        method=args.quantize,
        prompts_file=None if args.calibration_prompts is None else Path(args.calibration_prompts),
        samples=DEFAULT_SAMPLES if args.calibration_samples is None else args.calibration_samples,
    )


def export_options(req: ExportRequest) -> ExportOptions:
    """The options of a request: the static shape from its shape flags (the family's size by default), the
    quantization from its three flags, the weight format int8 with --quantize; the other fields by name."""
    static = None
    if not req.dynamic:
        size = req.resolution
        if size is None and (req.height is None or req.width is None):
            size = default_size(req.src)
        static = StaticShape(
            batch_size=req.batch_size,
            height=req.height or size,
            width=req.width or size,
            num_images_per_prompt=req.num_images_per_prompt,
        )
    quantize = quantize_options(req)
    tome = check_ratio(req.tome)
    if req.tome_mlp and tome == 0:
        raise ExportError("--tome-mlp needs --tome RATIO above 0")
    derived = {
        "static": static,
        "quantize": quantize,
        "weight_format": req.weight_format or ("int8" if quantize is not None else "fp32"),
        "tome": tome,
    }
    same = {f.name: getattr(req, f.name) for f in fields(ExportOptions) if f.name not in derived}
    return ExportOptions(**derived, **same)


def main_args(args: Any, console: TextIO | None = None) -> int:
    """Entry point of ``xeonsd export`` (parsed by :mod:`xeonsd.cli` from :class:`ExportRequest`)."""
    req = from_args(ExportRequest, args)
    opts = export_options(req)
    out = export(req.src, req.out, opts)
    static = None if opts.static is None else asdict(opts.static)
    print(json.dumps({"out": str(out), "static_shape": static}), file=console)
    return 0


__all__ = ["ExportDirError", "ExportError", "ExportOptions", "export", "reshape_static", "check_source"]
