"""``xeonsd serve --adapter NAME=PATH[:ALPHA]``: LoRA files registered by name, checked and converted at start-up.

``--adapter`` registers a LoRA file (either layout ``xeonsd generate --lora`` takes) under NAME; a request's
``model`` picks the base (the export's name, or no ``model``) or one adapter. Every adapter is checked against the
export as ``generate --lora`` checks it (family, what GenAI can apply, module names and shapes) and converted to the
kohya layout GenAI applies (:mod:`xeonsd.openvino.lora_files`). On SDXL an adapter's text-encoder part cannot be
switched per request (GenAI applies ``lora_te_`` to both text encoders alike, see :mod:`xeonsd.openvino.pipelines`),
so such an adapter is refused with the fused export as the way out.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from xeonsd.serve.options import ServeError

if TYPE_CHECKING:
    from xeonsd.serve.options import ServedModel, ServeOptions


def add_adapters(served: ServedModel, opts: ServeOptions, manifest: dict[str, Any], workdir: Path) -> None:
    """Check every ``--adapter`` against the export and write it in GenAI's layout into ``workdir``."""
    from xeonsd.openvino import lora_files

    export_dir, family, name = served.export_dir, served.family, served.name
    if not family.genai_adapters:
        raise ServeError(
            f"--adapter: OpenVINO GenAI has no LoRA adapters for {family.label}; fuse the adapter into an export "
            f"and serve that: xeonsd export SRC OUT --lora {opts.adapters[0].path}"
        )
    weights = lora_files.ir_weight_shapes(export_dir)
    label = f"{export_dir} (exported from {manifest.get('source')})"
    for i, spec in enumerate(opts.adapters):
        if spec.name == name:
            raise ServeError(f"--adapter {spec.name}: that is the base model's name; choose another")
        if not spec.path.is_file():
            raise ServeError(f"--adapter {spec.name}: LoRA file {spec.path} does not exist")
        modules = lora_files.read_adapter(spec.path)
        lora_files.check_family(spec.path, modules, family, label)
        lora_files.check_genai_limits(spec.path, modules)
        lora_files.check_fits(spec.path, modules, weights, label)
        unet = lora_files.PREFIXES[family.denoiser]
        if not family.genai_text_adapters and any(not k.startswith(unet) for k in modules):
            raise ServeError(
                f"--adapter {spec.name}: {spec.path} also adapts the text encoders, which OpenVINO GenAI cannot "
                f"switch per request on {family.label}; fuse it into an export instead: "
                f"xeonsd export SRC OUT --lora {spec.path}"
            )
        converted = workdir / f"{i}-{spec.name}.safetensors"
        lora_files.convert_for_genai_of(spec.path, modules, converted, family.denoiser)
        served.adapters[spec.name] = (converted, float(spec.alpha))
