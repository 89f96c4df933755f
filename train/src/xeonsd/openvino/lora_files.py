"""LoRA files for OpenVINO GenAI: our trainer's diffusers/peft layout converted to the kohya layout, and the checks
that an adapter fits an exported model before GenAI gets it.

* Our trainer (``xeonsd train --method lora``) writes ``pytorch_lora_weights.safetensors`` the way diffusers does:
  ``unet.<module>.lora.down.weight`` / ``.lora.up.weight`` (text encoder: ``text_encoder.<module>.lora_linear_layer.
  down.weight``; peft's own names ``lora_A``/``lora_B`` are read too). ``openvino_genai.Adapter`` ignores that
  layout ("Unused LoRA tensor" for every tensor, the image does not change); it applies the kohya/A1111 layout:
  ``lora_unet_<module with . -> _>.lora_down.weight``, ``.lora_up.weight`` and ``.alpha`` (``lora_te_`` for the
  text encoder). :func:`convert_for_genai` writes that layout to a file of its own; the user's file is only read.
* The diffusers layout keeps each component's alpha in the file's metadata (``lora_adapter_metadata``:
  ``unet.lora_alpha``, ``text_encoder.lora_alpha``, as our trainer and diffusers' ``save_lora_weights`` write it);
  where a file has none, diffusers' ``load_lora_weights`` uses alpha = rank (scale 1), and so does the conversion,
  so both apply the same weights.
* GenAI cannot apply LoRA to non-pointwise convolutions (kernel larger than 1x1): :func:`check_genai_limits`
  refuses such an adapter naming the modules. :func:`check_fits` refuses an adapter made for another base model
  (a module the model does not have, or another shape) naming the adapter file and the model.

Tensors are read and written with numpy: the genai engine needs no PyTorch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# SDXL's second text encoder: kohya's ``lora_te2_`` (its first is ``lora_te1_`` there, read as ``lora_te_``).
PREFIXES = {"unet": "lora_unet_", "text_encoder": "lora_te_", "text_encoder_2": "lora_te2_"}
# diffusers/peft key: <component>.<module>.<lora part>.weight -> (down|up)
_DIFFUSERS = re.compile(
    r"^(?P<comp>unet|text_encoder_2|text_encoder)\.(?P<module>.+?)\."
    r"(?P<part>lora\.down|lora\.up|lora_linear_layer\.down|lora_linear_layer\.up|lora_A|lora_B)\.weight$"
)
_KOHYA = re.compile(
    r"^(?P<name>lora_(?:unet|te|te1|te2)_[A-Za-z0-9_]+)\.(?P<part>lora_down\.weight|lora_up\.weight|alpha)$"
)
_DOWN = {"lora.down", "lora_linear_layer.down", "lora_A", "lora_down.weight"}
# What a module's weight is called in an optimum-intel OpenVINO IR: a Constant named ``self.<module>.weight``.
# (optimum-intel wraps the SDXL UNet for export: its weights are ``self.model.<module>.weight``.)
_IR_WEIGHT = re.compile(r"^self\.(?:model\.)?(?P<module>.+)\.weight$")


class LoraFormatError(ValueError):
    """The adapter file cannot be read, or does not fit the model, or GenAI cannot apply it."""


@dataclass
class LoraModule:
    """One adapted module: the kohya name, the dotted module name where known, and its matrices."""

    name: str  # lora_unet_down_blocks_0_..._to_q
    module: str | None  # down_blocks.0....to_q (None for a file already in the kohya layout)
    down: np.ndarray | None = None
    up: np.ndarray | None = None
    alpha: float | None = None

    @property
    def rank(self) -> int:
        assert self.down is not None
        return int(self.down.shape[0])

    @property
    def label(self) -> str:
        return self.module or self.name


def kohya_name(component: str, module: str) -> str:
    return PREFIXES[component] + module.replace(".", "_")


def parse_spec(spec: str) -> tuple[Path, float]:
    """``FILE[:ALPHA]`` -> (path, alpha); alpha defaults to 1.0. A path with a colon and no alpha stays whole."""
    head, sep, tail = spec.rpartition(":")
    if sep and head:
        try:
            return Path(head), float(tail)
        except ValueError:
            pass
    return Path(spec), 1.0


def _component_alphas(path: Path, metadata: dict[str, str]) -> dict[str, float]:
    """{component: lora_alpha} from the diffusers metadata (``lora_adapter_metadata``), where the file has it."""
    raw = metadata.get("lora_adapter_metadata")
    if not raw:
        return {}
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise LoraFormatError(f"LoRA file {path}: its lora_adapter_metadata is not JSON ({exc})") from exc
    return {comp: float(config[f"{comp}.lora_alpha"]) for comp in PREFIXES if f"{comp}.lora_alpha" in config}


def read_adapter(path: Path) -> dict[str, LoraModule]:
    """The adapter's modules by kohya name, from a file in the diffusers/peft or the kohya layout."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise LoraFormatError(f"LoRA file {path} does not exist")
    try:
        with safe_open(str(path), framework="numpy") as fh:
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 - safe_open is not a dict
            metadata = fh.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types (and TypeError for bf16 under numpy)
        raise LoraFormatError(f"LoRA file {path} cannot be read as safetensors: {exc}") from exc
    alphas = _component_alphas(path, metadata)
    modules: dict[str, LoraModule] = {}
    unknown = []
    for key, value in tensors.items():
        if m := _DIFFUSERS.match(key):
            name = kohya_name(m["comp"], m["module"])
            mod = modules.setdefault(
                name, LoraModule(name=name, module=f"{m['comp']}.{m['module']}", alpha=alphas.get(m["comp"]))
            )
            down = m["part"] in _DOWN
        elif m := _KOHYA.match(key):
            name = m["name"].replace("lora_te1_", "lora_te_", 1)  # kohya SDXL's first text encoder
            mod = modules.setdefault(name, LoraModule(name=name, module=None))
            if m["part"] == "alpha":
                mod.alpha = float(value)
                continue
            down = m["part"] in _DOWN
        else:
            unknown.append(key)
            continue
        if down:
            mod.down = value
        else:
            mod.up = value
    if unknown:
        raise LoraFormatError(
            f"LoRA file {path} has tensors of a layout xeonsd does not know, e.g. {unknown[0]!r} "
            "(expected the diffusers layout `unet.<module>.lora.down.weight` or kohya's `lora_unet_<module>.lora_down.weight`)"
        )
    if not modules:
        raise LoraFormatError(f"LoRA file {path} holds no LoRA tensors")
    for mod in modules.values():
        if mod.down is None or mod.up is None:
            raise LoraFormatError(f"LoRA file {path}: {mod.label} has no {'down' if mod.down is None else 'up'} matrix")
        if mod.down.ndim != mod.up.ndim or mod.down.ndim not in (2, 4) or mod.up.shape[1] != mod.down.shape[0]:
            raise LoraFormatError(
                f"LoRA file {path}: {mod.label} has down {list(mod.down.shape)} and up {list(mod.up.shape)}, "
                "which are not the two matrices of one adapter"
            )
    return modules


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


def check_fits(path: Path, modules: dict[str, LoraModule], weights: dict[str, tuple[int, ...]], model: str) -> None:
    """Refuse an adapter made for another base model: ``weights`` maps kohya names to the model's weight shapes."""
    for mod in sorted(modules.values(), key=lambda m: m.name):
        have = weights.get(mod.name)
        if have is None:
            raise LoraFormatError(
                f"LoRA file {path} was made for another base model than {model}: that model has no module {mod.label}"
            )
        want = (int(mod.up.shape[0]), int(mod.down.shape[1]))  # type: ignore[union-attr]
        if tuple(have[:2]) != want or (len(have) == 4 and mod.down.ndim == 4 and have[2:] != mod.down.shape[2:]):  # type: ignore[union-attr]
            raise LoraFormatError(
                f"LoRA file {path} was made for another base model than {model}: {mod.label} is "
                f"{'x'.join(map(str, have))} there, the adapter expects {'x'.join(map(str, want))}"
            )


def ir_weight_shapes(ov_dir: Path) -> dict[str, tuple[int, ...]]:
    """Kohya name -> weight shape of every named weight of the exported UNet and text encoder."""
    import openvino as ov

    core = ov.Core()
    out: dict[str, tuple[int, ...]] = {}
    for component in PREFIXES:
        xml = Path(ov_dir) / component / "openvino_model.xml"
        if component == "text_encoder_2" and not xml.is_file():
            continue  # SD 1.x/2.x
        model = core.read_model(xml)
        for op in model.get_ops():
            if op.get_type_name() == "Constant" and (m := _IR_WEIGHT.match(op.get_friendly_name())):
                out[kohya_name(component, m["module"])] = tuple(op.get_output_shape(0))
    return out


def torch_weight_shapes(unet, text_encoder, text_encoder_2=None) -> dict[str, tuple[int, ...]]:
    """Kohya name -> weight shape of a diffusers pipeline's UNet and text encoder(s)."""
    out: dict[str, tuple[int, ...]] = {}
    parts = (("unet", unet), ("text_encoder", text_encoder), ("text_encoder_2", text_encoder_2))
    for component, model in ((c, m) for c, m in parts if m is not None):
        for key, value in model.state_dict().items():
            if key.endswith(".weight"):
                out[kohya_name(component, key[: -len(".weight")])] = tuple(value.shape)
    return out


def convert_for_genai(path: Path, out: Path, modules: dict[str, LoraModule] | None = None) -> Path:
    """Write the adapter in the kohya layout GenAI applies to ``out``; alpha = rank where the file has none."""
    from safetensors.numpy import save_file

    modules = read_adapter(path) if modules is None else modules
    tensors: dict[str, np.ndarray] = {}
    for mod in modules.values():
        tensors[f"{mod.name}.lora_down.weight"] = np.ascontiguousarray(mod.down, dtype=np.float32)
        tensors[f"{mod.name}.lora_up.weight"] = np.ascontiguousarray(mod.up, dtype=np.float32)
        alpha = mod.alpha if mod.alpha is not None else float(mod.rank)
        tensors[f"{mod.name}.alpha"] = np.array(alpha, dtype=np.float32)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt", "source": json.dumps(str(path))})
    tmp.replace(out)
    return out


FAMILY_LABELS = {"sd": "SD 1.x/2.x", "sdxl": "SDXL"}


def lora_family(modules: dict[str, LoraModule]) -> tuple[str, str] | None:
    """The family an adapter was made for, read from its module names and shapes, with the evidence; None when
    they do not tell. SDXL: a second text encoder, attention in the UNet's first up block (SDXL's first down block
    has none) or 2048-wide cross-attention; SD 1.x/2.x: attention in the first down block, 768/1024-wide
    cross-attention."""
    names = list(modules)
    if any(n.startswith(PREFIXES["text_encoder_2"]) for n in names):
        return "sdxl", "it adapts a second text encoder (text_encoder_2)"
    for n in names:
        if n.startswith("lora_unet_up_blocks_0_attentions_"):
            return "sdxl", "it adapts attention in the UNet's first up block"
        if n.startswith("lora_unet_down_blocks_0_attentions_"):
            return "sd", "it adapts attention in the UNet's first down block"
    for mod in modules.values():
        if re.search(r"_attn2_to_[kv]$", mod.name) and mod.down is not None:
            width = int(mod.down.shape[1])
            if width in (768, 1024, 2048):
                return ("sdxl" if width == 2048 else "sd"), f"its cross-attention takes {width}-wide text features"
    return None


def check_family(path: Path, modules: dict[str, LoraModule], family: str, model: str) -> None:
    """Refuse an adapter made for the other family (SD 1.x/2.x vs SDXL), naming both."""
    found = lora_family(modules)
    if found is not None and found[0] != family:
        raise LoraFormatError(
            f"LoRA file {path} was made for {FAMILY_LABELS[found[0]]} ({found[1]}), and {model} is "
            f"{FAMILY_LABELS[family]}; use an adapter trained on an {FAMILY_LABELS[family]} model"
        )
