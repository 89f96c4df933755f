"""What ``xeonsd serve`` and ``--write-ovms-config`` serve, put together before anything loads: the engine
(:func:`choose_engine`), the options and the export (:mod:`.options`), the concept of ``--embeds`` (:mod:`.concept`)
and the adapters (:mod:`.adapters`).

``--engine auto`` serves an export on OpenVINO GenAI, and a diffusers pipeline directory of a family optimum-intel
has no export for (``FamilySpec.ov_pipeline_class`` empty: FLUX.1 Kontext, Qwen-Image-Edit-2511, Krea 2) on the
PyTorch engine, as ``xeonsd generate --engine auto`` does; a pipeline directory of a family that has an export is
refused, naming ``xeonsd export`` and ``--engine torch``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from xeonsd.openvino.manifest import MANIFEST, StaticShape
from xeonsd.serve.adapters import add_adapters
from xeonsd.serve.concept import add_concepts, read_concepts
from xeonsd.serve.options import (
    NAME,
    SERVE_ENGINES,
    ServedModel,
    ServeError,
    ServeOptions,
    blend_keys,
    check_options,
    read_export,
)

if TYPE_CHECKING:
    from xeonsd.families.detect import Family


def prepare(opts: ServeOptions, workdir: Path) -> ServedModel:
    """Check the export, ``--embeds`` and every adapter against it; write each adapter in GenAI's layout, and the
    overlay holding the concept, into ``workdir`` (the torch engine reads the files as they are)."""
    check_options(opts)
    _engine, found = choose_engine(opts)
    if found is not None:
        return prepare_torch(opts, found)
    manifest, shape, family = read_export(opts)
    concepts = read_concepts(opts, family)
    export_dir = Path(opts.export_dir)
    served = ServedModel(
        export_dir=export_dir,
        name=_name(opts),
        family=family,
        shape=shape,
        concept_tokens=list(manifest.get("concept_tokens", [])),
        max_sequence_length=manifest.get("max_sequence_length"),
        blends=blend_keys(opts),
    )
    if opts.adapters:
        add_adapters(served, opts, manifest, workdir)
    if concepts is not None:
        add_concepts(served, concepts, workdir / "models")
    return served


def _name(opts: ServeOptions) -> str:
    name = opts.name or Path(opts.export_dir).resolve().name
    if not NAME.match(name):
        raise ServeError(f"the export's name {name!r} is not a model name; give one with --name")
    return name


def choose_engine(opts: ServeOptions) -> tuple[str, Family | None]:
    """``--engine`` made concrete for the served directory: ``genai`` (no family read here: the export's manifest
    says it) or ``torch`` with the pipeline directory's detected family. Refuses a directory the engine cannot serve."""
    from xeonsd.families import FamilyError, detect_family

    src = Path(opts.export_dir)
    if opts.engine not in SERVE_ENGINES:
        raise ServeError(f"--engine {opts.engine!r}: choose one of {', '.join(SERVE_ENGINES)}")
    if (src / MANIFEST).is_file() or not (src / "model_index.json").is_file():
        if opts.engine == "torch":
            raise ServeError(
                f"--engine torch serves a diffusers pipeline directory (model_index.json), and {src} is "
                f"{'an OpenVINO export' if (src / MANIFEST).is_file() else 'not one'}: give the pipeline it was "
                "exported from (the base model with --adapter/--embeds, or a full fine-tune's output)"
            )
        if opts.size is not None:
            raise ServeError(f"--size is the torch engine's; an export's size is its static shape ({src})")
        return "genai", None
    try:
        found = detect_family(src)
    except FamilyError as e:
        raise ServeError(str(e)) from None
    spec = found.spec
    if opts.engine == "genai" or (opts.engine == "auto" and spec.ov_pipeline_class):
        raise ServeError(
            f"{src} is a diffusers pipeline of {spec.label}, not an xeonsd OpenVINO export (--engine {opts.engine}): "
            f"run `xeonsd export {src} OUT` and serve OUT, or give --engine torch"
        )
    if opts.write_ovms_config is not None:
        raise ServeError("--write-ovms-config: OVMS serves OpenVINO exports; the torch engine has no OVMS config")
    return "torch", found


def torch_shape(size: str | None, found: Family) -> StaticShape:
    """``--size WxH`` (default: the model's own resolution), each side a multiple of the family's pixel multiple."""
    if size is None:
        width = height = found.default_resolution
    else:
        w, sep, h = size.lower().partition("x")
        if not (sep and w.isdigit() and h.isdigit()):
            raise ServeError(f"--size {size!r}: expected WxH, e.g. 1024x1024")
        width, height = int(w), int(h)
    multiple = found.pixel_multiple
    if width < multiple or height < multiple or width % multiple or height % multiple:
        raise ServeError(f"--size {width}x{height}: each side must be a positive multiple of {multiple}")
    return StaticShape(batch_size=1, height=height, width=width, num_images_per_prompt=1)


def prepare_torch(opts: ServeOptions, found: Family) -> ServedModel:
    """The pipeline directory served on the torch engine: its adapters are loaded as they are by diffusers'
    ``load_lora_weights`` at start-up (LoRA and DoRA: a LoKr or LoHa is refused), ``--embeds``' concept added to its
    text encoder(s) there."""
    from xeonsd.openvino.adapter_fusion import adapter_kind

    family = found.spec
    concepts = read_concepts(opts, family)
    src = Path(opts.export_dir)
    served = ServedModel(
        export_dir=src,
        name=_name(opts),
        family=family,
        shape=torch_shape(opts.size, found),
        concept_tokens=[] if concepts is None else list(concepts["text_encoder"].tokens),
        max_sequence_length=family.prompt_length_of(src),
        blends=blend_keys(opts),
        engine="torch",
        concepts=concepts,
        sampling=family.training.sampling(dict(found.pipeline_config)),
    )
    for spec in opts.adapters:
        if spec.name == served.name:
            raise ServeError(f"--adapter {spec.name}: that is the base model's name; choose another")
        if not spec.path.is_file():
            raise ServeError(f"--adapter {spec.name}: LoRA file {spec.path} does not exist")
        if (kind := adapter_kind(spec.path).kind) in ("lokr", "loha"):
            raise ServeError(
                f"--adapter {spec.name}: {spec.path} is a {kind} adapter (peft's layout), which diffusers cannot "
                f"switch per request; generate with it merged instead: xeonsd generate {src} --engine torch --lora "
                f"{spec.path}"
            )
        served.adapters[spec.name] = (spec.path, float(spec.alpha))
    return served
