"""The adapter types beyond plain LoRA, fused into a diffusers pipeline: how ``xeonsd export --lora`` takes a DoRA,
LoKr or LoHa run (and ``xeonsd generate --engine torch --lora`` a LoKr or LoHa one).

OpenVINO GenAI applies B A only, so these reach OpenVINO by fusion: the adapter's update is merged into the
denoiser's weights before the export, and the export is the run's own, like a full fine-tune's.

* DoRA (diffusers' layout with peft's ``lora_magnitude_vector`` tensors): diffusers' ``load_lora_weights`` and
  ``fuse_lora``, as for plain LoRA; peft's merge rescales each output row of ``W + s B A`` to its learned magnitude;
* LoKr, LoHa (peft's layout, ``adapter_model.safetensors`` beside ``adapter_config.json``): ``PeftModel.
  from_pretrained`` on the denoiser, each adapted layer's scaling times the scale, ``merge_and_unload``
  (:func:`fuse_peft`).

:func:`adapter_kind` tells them apart from the files. A LoKr or LoHa file made for another family or base model is
refused in the LoRA checks' words (:mod:`xeonsd.modelfiles.lora_layout`), before any weight is changed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xeonsd.contracts.method_names import PEFT_FILES
from xeonsd.families import FamilySpec
from xeonsd.modelfiles.lora_layout import LoraFormatError, LoraModule, check_family, kohya_name

PEFT_WEIGHTS, PEFT_CONFIG = PEFT_FILES
PEFT_TYPES = {"LOKR": "lokr", "LOHA": "loha"}  # adapter_config.json's peft_type -> --adapter
# peft's key of a LoKr or LoHa tensor: base_model.model.<module>.<lokr_w1, hada_w1_a, ...>
_PEFT_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<part>(?:lokr|hada)_[a-z0-9_]+)$")
_UNET_BLOCKS = ("down_blocks.", "up_blocks.", "mid_block.")


@dataclass(frozen=True)
class Adapter:
    """What ``--lora PATH`` holds: ``kind`` (``lora``, ``dora``, ``lokr``, ``loha``) and its weights file."""

    kind: str
    path: Path

    @property
    def peft(self) -> bool:
        """Saved in peft's layout: merged by :func:`fuse_peft`, not read by diffusers' LoRA loaders."""
        return self.kind in PEFT_TYPES.values()


def adapter_kind(path: Path) -> Adapter:
    """The adapter at ``--lora PATH``: a directory, or ``adapter_model.safetensors`` beside ``adapter_config.json``,
    is peft's layout (the config's ``peft_type``); a file with ``lora_magnitude_vector`` tensors is DoRA; any other
    file LoRA (its reader checks it)."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    if path.is_dir() or (path.name == PEFT_WEIGHTS and (folder / PEFT_CONFIG).is_file()):
        return Adapter(_peft_type(folder), folder / PEFT_WEIGHTS)
    if not path.is_file():
        raise LoraFormatError(f"LoRA file {path} does not exist")
    dora = any(k.endswith(".lora_magnitude_vector") for k in _shapes(path))
    return Adapter("dora" if dora else "lora", path)


def _peft_type(folder: Path) -> str:
    config, weights = folder / PEFT_CONFIG, folder / PEFT_WEIGHTS
    if not config.is_file() or not weights.is_file():
        raise LoraFormatError(
            f"{folder} is no adapter in peft's layout: it needs {PEFT_WEIGHTS} and {PEFT_CONFIG} (what a LoKr or "
            "LoHa run leaves); give a LoRA or DoRA run's pytorch_lora_weights.safetensors as the file itself"
        )
    try:
        peft_type = json.loads(config.read_text()).get("peft_type")
    except (ValueError, AttributeError) as exc:
        raise LoraFormatError(f"{config} is not peft's adapter config (JSON object): {exc}") from exc
    if peft_type not in PEFT_TYPES:
        raise LoraFormatError(
            f"{config}: peft_type {peft_type!r}; xeonsd fuses peft's LOKR and LOHA adapters (LoRA and DoRA are read "
            "from diffusers' layout, pytorch_lora_weights.safetensors)"
        )
    return PEFT_TYPES[peft_type]


def _shapes(path: Path) -> dict[str, list[int]]:
    """Each tensor's shape, without reading the tensors."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as fh:
            return {k: list(fh.get_slice(k).get_shape()) for k in fh.keys()}  # noqa: SIM118 - not a dict
    except Exception as exc:  # safetensors raises its own error types
        raise LoraFormatError(f"LoRA file {path} cannot be read as safetensors: {exc}") from exc


def _in_features(parts: dict[str, list[int]]) -> int | None:
    """The input width of a linear layer's LoKr (w1 ⊗ w2: the product of both factors' widths) or LoHa (B1 A1: A1's
    width) update; None for a convolution's."""
    if all(len(s) == 2 for s in parts.values()):
        if "hada_w1_b" in parts:
            return parts["hada_w1_b"][1]
        w1, w2 = parts.get("lokr_w1", parts.get("lokr_w1_b")), parts.get("lokr_w2", parts.get("lokr_w2_b"))
        if w1 is not None and w2 is not None:
            return w1[1] * w2[1]
    return None


def peft_modules(path: Path) -> dict[str, LoraModule]:
    """The modules a LoKr or LoHa file adapts, named as :mod:`~xeonsd.modelfiles.lora_layout` names a LoRA's (the
    denoiser a UNet where a module is in its blocks, else a transformer), each with a stand-in ``down`` of its input
    width where that is known (what :func:`~xeonsd.modelfiles.lora_layout.lora_family` reads)."""
    parts: dict[str, dict[str, list[int]]] = {}
    for key, shape in _shapes(path).items():
        if not (m := _PEFT_KEY.match(key)):
            raise LoraFormatError(f"LoRA file {path}: {key!r} is no tensor of peft's LoKr or LoHa layout")
        parts.setdefault(m["module"], {})[m["part"]] = shape
    if not parts:
        raise LoraFormatError(f"LoRA file {path} holds no adapter tensors")
    denoiser = "unet" if any(m.startswith(_UNET_BLOCKS) for m in parts) else "transformer"
    modules = {}
    for module, shapes in parts.items():
        width = _in_features(shapes)
        down = None if width is None else np.empty((1, width), dtype=np.float32)
        modules[kohya_name(denoiser, module)] = LoraModule(kohya_name(denoiser, module), f"{denoiser}.{module}", down)
    return modules


def fuse_peft(pipe: Any, family: FamilySpec, weights: Path, scale: float, model: str) -> int:
    """Merge the LoKr or LoHa adapter ``weights`` (beside its ``adapter_config.json``) at ``scale`` into ``pipe``'s
    denoiser, refusing one made for another family or base model (``model`` names the pipeline); returns the number
    of adapted modules."""
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTunerLayer

    modules = peft_modules(weights)
    check_family(weights, modules, family, model)
    denoiser = getattr(pipe, family.denoiser)
    have = {name for name, _ in denoiser.named_modules()}
    missing = sorted(m.module.split(".", 1)[1] for m in modules.values() if m.module.split(".", 1)[1] not in have)  # type: ignore[union-attr]
    if missing:
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise LoraFormatError(
            f"LoRA file {weights} was made for another base model than {model}: its {family.denoiser} has no "
            f"module {', '.join(missing[:4])}{more}"
        )
    try:
        wrapped = PeftModel.from_pretrained(denoiser, str(weights.parent))
    except (RuntimeError, ValueError) as exc:  # torch's size mismatch, peft's missing modules
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        said = next((line for line in lines if "size mismatch" in line), lines[0] if lines else repr(exc))
        raise LoraFormatError(f"LoRA file {weights} was made for another base model than {model}: {said}") from exc
    for layer in wrapped.modules():
        if isinstance(layer, BaseTunerLayer):
            layer.scale_layer(scale)
    pipe.register_modules(**{family.denoiser: wrapped.merge_and_unload()})
    return len(modules)
