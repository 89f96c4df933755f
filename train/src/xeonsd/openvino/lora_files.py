"""LoRA files for OpenVINO GenAI: the checks that an adapter fits an exported model and that GenAI can apply it,
and the file GenAI gets.

The layouts and the converter between them are :mod:`xeonsd.modelfiles.lora_layout` (shared with the trainer's
``--save_format``). ``openvino_genai.Adapter`` ignores the diffusers layout ("Unused LoRA tensor" for every tensor,
the image does not change) and applies the kohya/A1111 one, so :func:`convert_for_genai` writes every adapter, in
either layout, to a kohya file of its own; the user's file is only read.

* FLUX.1 (:func:`convert_for_genai_flux`): GenAI 2026.4 maps a FLUX adapter's names itself
  (``flux_adapter_normalization``): kohya's BFL names with FLUX.1's widths written into the split of a single
  block's ``linear1`` (3072, 3072, 3072, 12288: any other width fails), XLabs' names, and every other name as it
  is; a name is then applied to every layer whose graph node name (``__module.<module>/aten::linear/MatMul``)
  contains it once ``transformer`` is cut from its front. diffusers' own ``transformer.<module>`` would also hit
  look-alikes (``.proj_out`` is in every single block's ``proj_out``), so the transformer part is written as
  ``transformer`` + ``__module.<module>/``, which names one layer, with each module's alpha, at any width
  (measured: a name the graph does not have is reported "Unused LoRA tensor"). GenAI ignores the ``.alpha`` of
  such names (the images are the same with it, without it, or at 1; measured on tiny-flux), so each module's
  alpha/rank is folded into its up matrix. CLIP-L's part stays kohya's ``lora_te_``.
* GenAI cannot apply LoRA to non-pointwise convolutions (kernel larger than 1x1): :func:`check_genai_limits`
  refuses such an adapter naming the modules. :func:`~xeonsd.modelfiles.lora_layout.check_fits` refuses an adapter made for
  another base model (a module the model does not have, or another shape) naming the adapter file and the model;
  :func:`ir_weight_shapes` gives it an export's weights.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from xeonsd.modelfiles.lora_layout import (
    PREFIXES,
    LoraFormatError,
    LoraModule,
    check_family,
    check_fits,
    kohya_name,
    lora_family,
    read_adapter,
    save_tensors,
    torch_weight_shapes,
    write_kohya,
)
from xeonsd.openvino.generate_args import parse_spec

__all__ = [
    "LoraFormatError",
    "LoraModule",
    "check_family",
    "check_fits",
    "check_genai_limits",
    "convert_for_genai",
    "convert_for_genai_flux",
    "convert_for_genai_of",
    "ir_weight_shapes",
    "lora_family",
    "parse_spec",
    "read_adapter",
    "torch_weight_shapes",
]

# What a module's weight is called in an optimum-intel OpenVINO IR: a Constant named ``self.<module>.weight``.
# (optimum-intel wraps the SDXL UNet for export: its weights are ``self.model.<module>.weight``.)
_IR_WEIGHT = re.compile(r"^self\.(?:model\.)?(?P<module>.+)\.weight$")


def check_genai_limits(path: Path, modules: dict[str, LoraModule]) -> None:
    """GenAI applies LoRA to matmuls and 1x1 convolutions only: refuse an adapter on a larger kernel."""
    convs = sorted(
        f"{m.label} ({m.down.shape[2]}x{m.down.shape[3]})"  # type: ignore[union-attr]
        for m in modules.values()
        if m.down is not None and m.down.ndim == 4 and m.down.shape[2] * m.down.shape[3] > 1
    )
    if convs:
        shown = ", ".join(convs[:4]) + (f" and {len(convs) - 4} more" if len(convs) > 4 else "")
        raise LoraFormatError(
            f"LoRA file {path} adapts non-pointwise convolutions, which OpenVINO GenAI cannot apply: {shown}; "
            f"fuse it into an export instead: xeonsd export SRC OUT --lora {path} --lora-scale S"
        )


def ir_weight_shapes(ov_dir: Path) -> dict[str, tuple[int, ...]]:
    """Kohya name -> weight shape of every named weight of the exported denoiser (UNet or transformer) and text
    encoder(s) that the export has."""
    import openvino as ov

    core = ov.Core()
    out: dict[str, tuple[int, ...]] = {}
    for component in PREFIXES:
        xml = Path(ov_dir) / component / "openvino_model.xml"
        if not xml.is_file():
            continue  # the other denoiser; SD 1.x/2.x's second text encoder
        model = core.read_model(xml)
        for op in model.get_ops():
            if op.get_type_name() == "Constant" and (m := _IR_WEIGHT.match(op.get_friendly_name())):
                out[kohya_name(component, m["module"])] = tuple(op.get_output_shape(0))
    return out


def convert_for_genai(path: Path, out: Path, modules: dict[str, LoraModule] | None = None) -> Path:
    """Write the adapter in the kohya layout GenAI applies to ``out``; alpha = rank where the file has none. The text
    encoder stays ``lora_te_``: GenAI ignores SDXL's ``lora_te1_``/``lora_te2_`` (the SDXL engine fuses those into
    the text encoders' weights and gives GenAI the UNet part only)."""
    return write_kohya(read_adapter(path) if modules is None else modules, out, str(path), sdxl_names=False)


def convert_for_genai_flux(modules: dict[str, LoraModule], out: Path, source: str) -> Path:
    """A FLUX.1 adapter in the names GenAI applies to FLUX (see the module doc): ``transformer__module.<module>/
    .lora_A.weight``/``lora_B`` for the transformer, kohya's ``lora_te_`` for CLIP-L, alpha/rank folded into the up
    matrices (alpha = rank); fp32."""
    tensors: dict[str, np.ndarray] = {}
    prefix = PREFIXES["transformer"]
    for mod in modules.values():
        if mod.name.startswith(prefix):
            assert mod.module is not None  # read_adapter resolves every transformer module
            key = "transformer__module." + mod.module[len("transformer.") :] + "/"
            down, up = f"{key}.lora_A.weight", f"{key}.lora_B.weight"
        else:
            key = mod.name
            down, up = f"{key}.lora_down.weight", f"{key}.lora_up.weight"
        tensors[down] = np.ascontiguousarray(mod.down, dtype=np.float32)
        tensors[up] = np.ascontiguousarray(np.asarray(mod.up) * mod.scale, dtype=np.float32)  # alpha/rank folded
        tensors[f"{key}.alpha"] = np.array(mod.rank, dtype=np.float32)  # scale 1 whether GenAI divides or not
    return save_tensors(tensors, out, {"format": "pt", "source": source})


def convert_for_genai_of(path: Path, modules: dict[str, LoraModule], out: Path, denoiser: str) -> Path:
    """The adapter as GenAI applies it to a model whose denoiser is ``denoiser``: a transformer's (FLUX.1, FLUX.2
    [klein], Qwen-Image) in :func:`convert_for_genai_flux`'s names, a UNet's in kohya's (:func:`convert_for_genai`).
    GenAI 2026.4.1 applies neither kohya's ``lora_transformer_`` names nor diffusers' to FLUX.2 or Qwen-Image (the
    image does not change) but applies the graph-node names to both (measured on tiny-flux2 and tiny-qwenimage)."""
    if denoiser == "transformer":
        return convert_for_genai_flux(modules, out, str(path))
    return convert_for_genai(path, out, modules)
