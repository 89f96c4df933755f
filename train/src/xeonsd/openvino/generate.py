"""``xeonsd generate``: images from an OpenVINO export, through optimum-intel or OpenVINO GenAI, or from a diffusers
pipeline through PyTorch.

This module holds the request's plan of calls, the choice of engine and the output (the request,
:class:`GenerateOptions`, is defined with its flags in :mod:`xeonsd.openvino.generate_args`);
the two OpenVINO engines, ``optimum`` and ``genai``, and what each needs are in :mod:`xeonsd.openvino.engines`, the
PyTorch engine (``torch``: the family's diffusers pipeline, for the families optimum-intel has no export for) in
:mod:`xeonsd.torch_engine`. ``--engine auto`` (the command line's default) runs an export on ``genai`` and a
pipeline directory of a family without an OpenVINO export (FLUX.1 Kontext, Qwen-Image-Edit) on ``torch``; a pipeline
directory of a family that has one is refused, naming ``xeonsd export`` and ``--engine torch``
(:func:`resolve_engine`).

A static export makes images in calls of exactly ``batch_size x num_images_per_prompt``; a request that does not
fit is refused with the shape the model has. ``--embeds`` adds a learned concept to the exported text encoder
at load time (no re-export), giving the same images as an export with the concept baked in. ``--lora FILE[:ALPHA]``
(genai only) blends LoRA adapters into the exported UNet/text encoder at compile time through GenAI's
``Adapter``/``AdapterConfig``; our trainer's files are converted to the layout GenAI applies (:mod:`xeonsd.openvino.lora_files`).
Output: ``image_000.png`` …, ``grid.png`` and ``timings.json`` (load, compile, first image, per-call latency,
images/s).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from xeonsd.families import FamilySpec, detect_family, of_manifest
from xeonsd.flags import from_args
from xeonsd.fsutil import atomic_dir
from xeonsd.openvino.engines import Engine, GenaiEngine, GenerateError, OptimumEngine
from xeonsd.openvino.generate_args import (
    ENGINE_CHOICES,
    ENGINES,
    PRECISIONS,
    TORCH,
    GenerateCommand,
    GenerateOptions,
)
from xeonsd.openvino.manifest import MANIFEST, StaticShape, check_writable_output, read_manifest, static_shape

log = logging.getLogger(__name__)

DEFAULT_SIZE = 512


@dataclass(frozen=True)
class Call:
    """One pipeline call: ``len(prompts) x per_prompt`` images from ``seed``."""

    prompts: list[str]
    per_prompt: int
    seed: int


@dataclass(frozen=True)
class Plan:
    shape: StaticShape  # the shape every call has (for a dynamic export: the one requested)
    static: bool
    calls: list[Call]


def resolve_engine(src: Path, opts: GenerateOptions) -> tuple[GenerateOptions, dict[str, Any]]:
    """``opts`` with ``--engine auto``/``openvino`` made concrete for SRC, and what the request is planned on: the
    export's manifest, or for the torch engine a dynamic one made from the pipeline directory (its family, default
    size, pixel multiple and long prompt length). Refuses an engine that cannot run SRC, in one line."""
    src = Path(src)
    if opts.engine not in ENGINE_CHOICES:
        raise GenerateError(f"unknown engine {opts.engine!r}; choose one of {', '.join(ENGINE_CHOICES)}")
    if (src / MANIFEST).is_file() or not (src / "model_index.json").is_file():
        if opts.engine == TORCH and (src / MANIFEST).is_file():
            raise GenerateError(
                f"--engine torch runs a diffusers pipeline, and {src} is an OpenVINO export: give the pipeline it "
                "was exported from (a base model with --lora/--embeds, or a full fine-tune's output)"
            )
        manifest = read_manifest(src)  # says what is wrong with a directory that is neither
        return replace(opts, engine="genai" if opts.engine in ("auto", "openvino") else opts.engine), manifest
    found = detect_family(src)
    spec = found.spec
    if opts.engine != TORCH and not (opts.engine == "auto" and not spec.ov_pipeline_class):
        if not spec.ov_pipeline_class:
            raise GenerateError(
                f"--engine {opts.engine}: optimum-intel has no OpenVINO export for {spec.label} "
                f"({spec.pipeline_class}); use --engine torch (or auto)"
            )
        raise GenerateError(
            f"{src} is not an xeonsd OpenVINO export but a diffusers pipeline of {spec.label} (--engine "
            f"{opts.engine} runs an export): run `xeonsd export {src} OUT` and generate from OUT, or give --engine torch"
        )
    manifest = {
        "family": spec.name,
        "source": str(src),
        "default_resolution": found.default_resolution,
        "pixel_multiple": found.pixel_multiple,
        "max_sequence_length": spec.prompt_length_of(src),
        # the guidance its checkpoint asks for, as the trainer's validation images (Krea 2 Turbo: 0; None: the
        # family's)
        "guidance_scale": spec.training.sampling(dict(found.pipeline_config)).get("guidance_scale"),
    }
    return replace(opts, engine=TORCH), manifest


def plan_calls(manifest: dict[str, Any], opts: GenerateOptions) -> Plan:
    """Split the request into calls of the export's shape; refuse what a static export cannot do."""
    if opts.engine not in (*ENGINES, TORCH):
        raise GenerateError(f"unknown engine {opts.engine!r}; choose one of {', '.join((*ENGINES, TORCH))}")
    if not opts.prompts or any(not p.strip() for p in opts.prompts):
        raise GenerateError("give at least one non-empty --prompt")
    if opts.num_images < 1 or opts.steps < 1:
        raise GenerateError("--num-images and --steps must be at least 1")
    if opts.precision not in PRECISIONS:
        raise GenerateError(f"unknown --precision {opts.precision!r}; choose one of {', '.join(PRECISIONS)}")
    fixed = static_shape(manifest)
    if fixed is not None:
        asked = {"--height": (opts.height, fixed.height), "--width": (opts.width, fixed.width)}
        asked["--batch-size"] = (opts.batch_size, fixed.batch_size)
        for flag, (value, have) in asked.items():
            if value is not None and value != have:
                raise GenerateError(
                    f"{flag} {value} does not fit this export: it has a {fixed.describe()}; "
                    "re-export with that shape or with --dynamic"
                )
        if opts.num_images % fixed.images_per_call:
            raise GenerateError(
                f"--num-images {opts.num_images} does not fit this export: it has a {fixed.describe()}, so it makes "
                f"images in calls of {fixed.images_per_call}; ask for a multiple of {fixed.images_per_call} "
                "or re-export with --dynamic"
            )
        shape = fixed
    else:
        size = int(manifest.get("default_resolution") or DEFAULT_SIZE)  # the family's (SDXL 1024)
        height, width = opts.height or size, opts.width or size
        multiple = int(manifest.get("pixel_multiple") or 8)  # a pipeline directory's (FLUX: 16); an export's 8
        if height % multiple or width % multiple:
            raise GenerateError(f"--height/--width must be multiples of {multiple}, got {height}x{width}")
        batch = opts.batch_size or opts.num_images
        if opts.num_images % batch:
            raise GenerateError(f"--num-images {opts.num_images} is not a multiple of --batch-size {batch}")
        shape = StaticShape(batch_size=batch, height=height, width=width, num_images_per_prompt=1)
    calls = []
    n_prompts = len(opts.prompts)
    for k in range(opts.num_images // shape.images_per_call):
        first = k * shape.batch_size
        prompts = [opts.prompts[(first + b) % n_prompts] for b in range(shape.batch_size)]
        calls.append(Call(prompts=prompts, per_prompt=shape.num_images_per_prompt, seed=opts.seed + k))
    if opts.engine == "genai" and any(len(set(c.prompts)) > 1 for c in calls):
        raise GenerateError(
            f"--engine genai makes one prompt per call, and this request puts {shape.batch_size} different prompts "
            "in a call; give one prompt, or use --engine optimum"
        )
    return Plan(shape=shape, static=fixed is not None, calls=calls)


def check_loras(opts: GenerateOptions, family: FamilySpec) -> None:
    """``--lora`` needs the torch engine (diffusers' ``load_lora_weights`` reads every family's adapters) or the genai
    engine on a family GenAI has adapters for (``FamilySpec.genai_adapters``; not SD3), and existing files; checked
    before any model is loaded."""
    if not opts.loras:
        return
    first = opts.loras[0][0]
    if opts.engine != TORCH and not family.genai_adapters:
        raise GenerateError(
            f"--lora: OpenVINO GenAI has no LoRA adapters for {family.label}; fuse the adapter into an export "
            f"instead: xeonsd export SRC OUT --lora {first} --lora-scale S"
        )
    if opts.engine not in ("genai", TORCH):
        raise GenerateError(
            f"--engine {opts.engine} has no runtime LoRA; use --engine genai, or fuse the adapter into an export: "
            f"xeonsd export SRC OUT --lora {first} --lora-scale S"
        )
    for path, _alpha in opts.loras:
        if not Path(path).is_file():
            raise GenerateError(f"LoRA file {path} does not exist")


def check_references(opts: GenerateOptions, family: FamilySpec) -> None:
    """``--image``: an edit model's reference images, as many as its pipeline takes (``FamilySpec.
    reference_images``; one at least where it needs one), on the torch engine; checked before any model loads."""
    given, most = len(opts.references), family.reference_images
    if given and not most:
        raise GenerateError(f"--image: {family.label} takes no reference images (it is not an edit model)")
    if given > most:
        raise GenerateError(f"--image given {given} times: {family.label} takes at most {most} reference image(s)")
    if given and opts.engine != TORCH:
        raise GenerateError(
            f"--image: --engine {opts.engine} makes images from text only; give --engine torch, which passes "
            "reference images to the family's pipeline"
        )
    if family.reference_required and not given:
        raise GenerateError(f"{family.label} edits reference images: give one with --image PATH (up to {most})")
    for path in opts.references:
        if not Path(path).is_file():
            raise GenerateError(f"reference image {path} does not exist")


def open_engine(ov_dir: Path, opts: GenerateOptions) -> Engine:
    """Check SRC (an export, or a pipeline directory for the torch engine) and the request, then load (and compile)
    the pipeline of the engine :func:`resolve_engine` chooses."""
    ov_dir = Path(ov_dir)
    opts, manifest = resolve_engine(ov_dir, opts)
    plan = plan_calls(manifest, opts)
    if opts.embeds is not None and not Path(opts.embeds).is_file():
        raise GenerateError(f"embeddings file {opts.embeds} does not exist")
    family = of_manifest(manifest)
    if opts.embeds is not None and (family.objective == "flow" or family.concept_layout is None):
        raise GenerateError(f"--embeds: textual inversion is not served for {family.label}; use a LoRA (--lora)")
    check_loras(opts, family)
    check_references(opts, family)
    for _, tokenizer in family.text_side if opts.engine == "genai" else ():
        if not (ov_dir / tokenizer / "openvino_tokenizer.xml").is_file():
            raise GenerateError(f"{ov_dir} has no {tokenizer}/openvino_tokenizer.xml, which --engine genai needs")
    if opts.guidance_scale is None:
        given = manifest.get("guidance_scale")  # a pipeline directory's own (torch engine), where it has one
        opts = replace(opts, guidance_scale=family.guidance_scale if given is None else float(given))
    if opts.engine == TORCH:
        from xeonsd.torch_engine import TorchEngine

        cls: type[Engine] = TorchEngine
    else:
        cls = OptimumEngine if opts.engine == "optimum" else GenaiEngine
    engine = cls(
        ov_dir=ov_dir,
        plan=plan,
        opts=opts,
        concept_tokens=list(manifest.get("concept_tokens", [])),
        source=str(manifest.get("source")),
        family=family,
        max_sequence_length=manifest.get("max_sequence_length"),
    )
    try:
        return engine.open()
    except BaseException:
        engine.close()  # the temporary files of a failed open (converted adapters, concept overlay)
        raise


def generate(ov_dir: Path, opts: GenerateOptions) -> tuple[list[Any], dict[str, Any]]:
    """Make ``opts.num_images`` images; return them (PIL) and the timings."""
    engine = open_engine(ov_dir, opts)
    try:
        images: list[Any] = []
        latencies = []
        for i, call in enumerate(engine.plan.calls):
            t0 = time.perf_counter()
            images.extend(engine.run(call))
            latencies.append(time.perf_counter() - t0)
            log.info("call %d/%d: %d image(s) in %.2f s", i + 1, len(engine.plan.calls), len(images), latencies[-1])
    finally:
        engine.close()
    timings = {
        "engine": engine.opts.engine,  # the one that ran (auto and openvino resolved)
        "precision": opts.precision,
        **({"torch_dtype": str(dtype).removeprefix("torch.")} if (dtype := getattr(engine, "dtype", None)) else {}),
        "load_s": round(engine.load_s, 3),
        "compile_s": round(engine.compile_s, 3),
        "first_image_s": round(latencies[0], 3),
        "call_latency_s": [round(x, 3) for x in latencies],
        "images_per_s": round(len(images) / sum(latencies), 4),
        "num_images": len(images),
        "steps": opts.steps,
        "shape": asdict(engine.plan.shape),
        "static": engine.plan.static,
        "seeds": [c.seed for c in engine.plan.calls],
        "prompts": list(opts.prompts),
    }
    return images, timings


def make_grid(images: list[Any]) -> Any:
    """All images in one picture, in rows of ``ceil(sqrt(n))``."""
    from PIL import Image

    cols = math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / cols)
    w, h = images[0].size
    grid = Image.new("RGB", (cols * w, rows * h), "white")
    for i, img in enumerate(images):
        grid.paste(img, ((i % cols) * w, (i // cols) * h))
    return grid


def generate_to_dir(ov_dir: Path, out: Path, opts: GenerateOptions, overwrite: bool = False) -> dict[str, Any]:
    """Generate and write ``image_NNN.png``, ``grid.png`` and ``timings.json`` to OUT (atomically)."""
    out = Path(out)
    check_writable_output(out, overwrite)
    images, timings = generate(ov_dir, opts)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        for i, img in enumerate(images):
            img.save(tmp / f"image_{i:03d}.png")
        make_grid(images).save(tmp / "grid.png")
        (tmp / "timings.json").write_text(json.dumps(timings, indent=2) + "\n")
    return timings


def main_args(args: Any, console: TextIO | None = None) -> int:
    """Entry point of ``xeonsd generate`` (parsed by :mod:`xeonsd.cli`)."""
    cmd, opts = from_args(GenerateCommand, args), from_args(GenerateOptions, args)
    timings = generate_to_dir(cmd.ov_dir, cmd.out, opts, overwrite=cmd.overwrite)
    print(
        json.dumps({"out": str(cmd.out), **{k: timings[k] for k in ("load_s", "compile_s", "images_per_s")}}),
        file=console,
    )
    return 0
