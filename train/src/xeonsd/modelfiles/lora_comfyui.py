"""Adapters in the layout ComfyUI loads (``--save_format comfyui``): every family, every adapter type.

Written from the adapted modules themselves (peft's layers on the denoiser and the text encoders), as ComfyUI's
loader reads them (Comfy-Org/ComfyUI: ``comfy/lora.py`` at 17358c8f, its ``model_lora_keys_unet``,
``model_lora_keys_clip`` and ``load_lora``; ``comfy/utils.py`` at 09708eae, the diffusers-name maps of each
transformer; ``comfy/weight_adapter/`` ``lora.py``, ``lokr.py``, ``loha.py`` and ``base.py`` at a125cd84):

* **Names**: a UNet's modules (SD 1.x/2.x, SDXL) under kohya's ``lora_unet_<module, dots as _>``; a transformer's
  under ``transformer.<diffusers module>``, which ComfyUI maps onto its own layers for SD3, FLUX.1 and Kontext,
  FLUX.2, Krea 2, Z-Image and Qwen-Image (query/key/value onto its fused layers, by offset); the CLIP text
  encoders' under ``text_encoder.<module>`` and ``text_encoder_2.<module>`` (ComfyUI's "diffusers" names for
  CLIP-L/H and CLIP-G).
* **LoRA**: ``.lora_down.weight`` (A), ``.lora_up.weight`` (B) and ``.alpha``. ComfyUI multiplies B A by
  alpha / rank, and by 1 where a module has no alpha, so the alpha is always written: a file without it loads at
  the wrong strength whenever ``--lora_alpha`` is not the rank.
* **LoKr** (LyCORIS' names): ``.lokr_w1`` or ``.lokr_w1_a``/``_b``, ``.lokr_w2`` or ``.lokr_w2_a``/``_b`` (and
  ``.lokr_t2``). ComfyUI scales the Kronecker product by alpha / the rank of the last factored matrix, and by 1
  where both are whole: the alpha is chosen so that this is peft's scale, or, with no factored matrix, the scale
  is folded into ``lokr_w1``.
* **LoHa** (LyCORIS' names): ``.hada_w1_a``, ``_w1_b``, ``_w2_a``, ``_w2_b`` (and ``.hada_t1``/``_t2``) and
  ``.alpha``, scaled by alpha / rank as peft does.
* **DoRA**: the LoRA pair plus ``.dora_scale`` of shape (out, 1). peft divides the magnitude by the row norms of
  the adapted weight W0 + s B A; ComfyUI, given a scale on the output axis, divides by those of the base weight
  W0. So the scale written is m * ||W0|| / ||W0 + s B A||: ComfyUI then computes peft's weight exactly, which
  needs the base weights at save time (the trainer has them).

Each tensor is fp32, contiguous; the file is written under a temporary name and renamed into place.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ADAPTER_NAME = "default"  # peft's adapter name, the one the trainer adds (diffusers' load_lora_weights: default_0)
# The peft parameters of each adapter type, as LyCORIS (and ComfyUI) name them: peft uses the same names.
LOKR_PARTS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")
LOHA_PARTS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")


class ComfyUIError(ValueError):
    """The adapted model cannot be written in ComfyUI's layout."""


def comfyui_name(component: str, module: str) -> str:
    """The module's name in a ComfyUI file: ``lora_unet_…`` for a UNet's, ``<component>.<module>`` otherwise."""
    if component == "unet":
        return "lora_unet_" + module.replace(".", "_")
    return f"{component}.{module}"


def _parts(layer, names: tuple[str, ...], adapter: str) -> dict[str, torch.Tensor]:
    """The adapter's parameters of ``layer`` among ``names`` (peft keeps each in a ParameterDict per adapter)."""
    found = {}
    for name in names:
        table = getattr(layer, name, None)
        if table is not None and adapter in table:
            found[name] = table[adapter].detach().float()
    return found


def _lora(layer, prefix: str, adapter: str) -> dict[str, torch.Tensor]:
    """A LoRA (or DoRA) layer: A, B, alpha = scale x rank; DoRA's magnitude as the scale ComfyUI needs."""
    import torch

    down = layer.lora_A[adapter].weight.detach().float()
    up = layer.lora_B[adapter].weight.detach().float()
    scale = float(layer.scaling[adapter])
    out = {
        f"{prefix}.lora_down.weight": down,
        f"{prefix}.lora_up.weight": up,
        f"{prefix}.alpha": torch.tensor(scale * down.shape[0]),
    }
    magnitudes = getattr(layer, "lora_magnitude_vector", None)
    if magnitudes is not None and adapter in magnitudes:
        base = layer.get_base_layer().weight.detach().float()
        adapted = base + scale * (up.flatten(1) @ down.flatten(1)).reshape(base.shape)
        rows = [1] * (base.dim() - 1)

        def norms(w: torch.Tensor) -> torch.Tensor:
            return w.reshape(w.shape[0], -1).norm(dim=1).reshape(w.shape[0], *rows)

        magnitude = magnitudes[adapter].weight.detach().float().reshape(base.shape[0], *rows)
        out[f"{prefix}.dora_scale"] = magnitude * norms(base) / norms(adapted)
    return out


def _lokr(layer, prefix: str, adapter: str) -> dict[str, torch.Tensor]:
    """A LoKr layer: peft's factors under their LyCORIS names, scaled as peft scales them."""
    import torch

    parts = _parts(layer, LOKR_PARTS, adapter)
    scale = float(layer.scaling[adapter])
    # comfy/weight_adapter/lokr.py: alpha / w2_b's rows where w2 is factored, else w1_b's, else no scale (1)
    factored = parts.get("lokr_w2_b", parts.get("lokr_w1_b"))
    out = {f"{prefix}.{k}": v for k, v in parts.items()}
    if factored is not None:
        out[f"{prefix}.alpha"] = torch.tensor(scale * factored.shape[0])
    else:
        out[f"{prefix}.lokr_w1"] = parts["lokr_w1"] * scale
    return out


def _loha(layer, prefix: str, adapter: str) -> dict[str, torch.Tensor]:
    """A LoHa layer: peft's factors under their LyCORIS names, alpha = scale x rank (w1_b's rows)."""
    import torch

    parts = _parts(layer, LOHA_PARTS, adapter)
    scale = float(layer.scaling[adapter])
    out = {f"{prefix}.{k}": v for k, v in parts.items()}
    out[f"{prefix}.alpha"] = torch.tensor(scale * parts["hada_w1_b"].shape[0])
    return out


def comfyui_tensors(components: Mapping[str, torch.nn.Module], adapter: str = ADAPTER_NAME) -> dict[str, torch.Tensor]:
    """Every module of ``components`` (``{"unet"|"transformer"|"text_encoder"|…: module}``) with peft's adapter
    ``adapter``, in ComfyUI's layout, fp32 and contiguous. A model with no such adapter is a :class:`ComfyUIError`."""
    from peft.tuners.loha import LoHaLayer
    from peft.tuners.lokr import LoKrLayer
    from peft.tuners.lora import LoraLayer

    tensors: dict[str, torch.Tensor] = {}
    for component, model in components.items():
        for module, layer in model.named_modules():
            prefix = comfyui_name(component, module)
            if isinstance(layer, LoraLayer) and adapter in layer.lora_A:
                tensors.update(_lora(layer, prefix, adapter))
            elif isinstance(layer, LoKrLayer) and adapter in layer.scaling:
                tensors.update(_lokr(layer, prefix, adapter))
            elif isinstance(layer, LoHaLayer) and adapter in layer.scaling:
                tensors.update(_loha(layer, prefix, adapter))
    if not tensors:
        raise ComfyUIError(f"no adapter {adapter!r} on {', '.join(components)}: nothing to write in ComfyUI's layout")
    return {k: v.contiguous() for k, v in tensors.items()}


def write_comfyui(components: Mapping[str, torch.nn.Module], out: Path, metadata: Mapping[str, str]) -> Path:
    """:func:`comfyui_tensors` of ``components`` written to ``out`` atomically, with ``metadata``."""
    from safetensors.torch import save_file

    from xeonsd.fsutil import atomic_path

    tensors = comfyui_tensors(components)
    with atomic_path(Path(out)) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt", **metadata})
    return Path(out)
