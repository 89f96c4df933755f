"""LoRA files in the two layouts people use, read into one form and written in either: the one converter that the
trainer (``--save_format``) and the OpenVINO side (``export --lora``, ``generate --lora``) share.

* diffusers/peft: what diffusers' ``save_lora_weights`` writes (and our trainer by default):
  ``unet.<module>.lora.down.weight`` / ``.lora.up.weight`` (text encoder: ``text_encoder.<module>.lora_linear_layer.
  down.weight``; peft's own names ``lora_A``/``lora_B`` are read too); each component's alpha in the file's
  metadata (``lora_adapter_metadata``: ``unet.lora_alpha``, ``text_encoder.lora_alpha``); where a file has none,
  diffusers' ``load_lora_weights`` uses alpha = rank (scale 1), and so does this module.
* kohya/A1111: what AUTOMATIC1111, Forge and ComfyUI load, and what OpenVINO GenAI's ``Adapter`` applies:
  ``lora_unet_<module with . -> _>.lora_down.weight``, ``.lora_up.weight`` and ``.alpha``, one alpha per module;
  the text encoder's modules are ``lora_te_`` (SD 1.x/2.x), on SDXL ``lora_te1_`` (``text_encoder``) and
  ``lora_te2_`` (``text_encoder_2``), the names kohya's sd-scripts write and the UIs' SDXL loaders expect. All three
  are read; :func:`write_kohya` writes ``lora_te1_`` for an SDXL adapter (GenAI's file keeps ``lora_te_``: GenAI
  ignores ``lora_te1_``, see :mod:`xeonsd.openvino.pipelines`).

In memory a module is named by its kohya name with ``lora_te_`` for the first text encoder in every family
(:data:`PREFIXES`); only the SDXL file's names differ.

The kohya names lose the dots, so the way back to module names needs the model's modules
(:func:`module_names`): a kohya module the model does not have is a :class:`LoraFormatError` naming it. Writing
the diffusers layout folds each module's alpha/rank into its up matrix and leaves the alpha out, so every reader
applies the same weights. :func:`check_fits` refuses an adapter made for another base model (modules the model
lacks, or other shapes), naming the adapter file, the model and the modules.

Tensors are read and written with numpy (no PyTorch needed); files are written to a temporary name and renamed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xeonsd.families import REGISTRY, FamilySpec
from xeonsd.modelfiles import lora_flux

LAYOUTS = ("diffusers", "kohya")
# SDXL's and SD3's second text encoder: kohya's ``lora_te2_`` (its first is ``lora_te1_`` there, read as
# ``lora_te_``). FLUX.1's and SD3's transformer is ``lora_transformer_<module>`` in memory; a FLUX.1 kohya file
# names its modules BFL's way (``lora_unet_double_blocks_…``, see :mod:`xeonsd.modelfiles.lora_flux`).
PREFIXES = {
    "unet": "lora_unet_",
    "transformer": "lora_transformer_",
    "text_encoder": "lora_te_",
    "text_encoder_2": "lora_te2_",
}
SDXL_TE1_PREFIX = "lora_te1_"  # the first text encoder's prefix in an SDXL kohya file
# diffusers/peft key: <component>.<module>.<lora part>.weight -> (down|up)
_DIFFUSERS = re.compile(
    r"^(?P<comp>unet|transformer|text_encoder_2|text_encoder)\.(?P<module>.+?)\."
    r"(?P<part>lora\.down|lora\.up|lora_linear_layer\.down|lora_linear_layer\.up|lora_A|lora_B)\.weight$"
)
_KOHYA = re.compile(
    r"^(?P<name>lora_(?:unet|te|te1|te2)_[A-Za-z0-9_]+)\.(?P<part>lora_down\.weight|lora_up\.weight|alpha)$"
)
_DOWN = {"lora.down", "lora_linear_layer.down", "lora_A", "lora_down.weight"}


class LoraFormatError(ValueError):
    """The adapter file cannot be read, or does not fit the model, or GenAI cannot apply it."""


@dataclass
class LoraModule:
    """One adapted module: the kohya name, the dotted module name where known, and its matrices."""

    name: str  # lora_unet_down_blocks_0_..._to_q
    module: str | None  # unet.down_blocks.0....to_q (None for a file in the kohya layout until resolved)
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

    @property
    def scale(self) -> float:
        """alpha / rank: what the up x down product is multiplied by (alpha = rank where the file has none)."""
        return (self.alpha if self.alpha is not None else float(self.rank)) / self.rank


def kohya_name(component: str, module: str) -> str:
    return PREFIXES[component] + module.replace(".", "_")


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


def _load(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    from safetensors import safe_open

    if not path.is_file():
        raise LoraFormatError(f"LoRA file {path} does not exist")
    try:
        with safe_open(str(path), framework="numpy") as fh:
            return {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata() or {}  # noqa: SIM118 - not a dict
    except Exception as exc:  # safetensors raises its own error types (and TypeError for bf16 under numpy)
        raise LoraFormatError(f"LoRA file {path} cannot be read as safetensors: {exc}") from exc


# The key parts of the adapter types that are not plain LoRA (peft's names, kohya's DoRA name): named when refused.
OTHER_ADAPTERS = (("lora_magnitude_vector", "DoRA"), ("dora_scale", "DoRA"), ("lokr_", "LoKr"), ("hada_", "LoHa"))


def read_adapter(path: Path, dora: bool = False) -> dict[str, LoraModule]:
    """The adapter's modules by kohya name, from a file in the diffusers/peft or the kohya layout; DoRA, LoKr and LoHa
    are refused by name, but with ``dora`` DoRA's magnitude vectors pass, unread (export fusion hands them to peft)."""
    path = Path(path)
    tensors, metadata = _load(path)
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
            name = m["name"].replace(SDXL_TE1_PREFIX, PREFIXES["text_encoder"], 1)  # kohya SDXL's first encoder
            mod = modules.setdefault(name, LoraModule(name=name, module=None))
            if m["part"] == "alpha":
                mod.alpha = float(value)
                continue
            down = m["part"] in _DOWN
        else:
            unknown += [] if dora and key.endswith(".lora_magnitude_vector") else [key]
            continue
        if down:
            mod.down = value
        else:
            mod.up = value
    if kind := next((k for part, k in OTHER_ADAPTERS if any(part in key for key in unknown)), None):
        raise LoraFormatError(
            f"{path} is a {kind} adapter, not plain LoRA: OpenVINO GenAI and xeonsd's runtime LoRA (generate --lora, "
            f"serve --adapter) apply B A only. Fix: fuse it into an export of its own (xeonsd export SRC OUT --lora "
            f"{path}; docs/trainer.md#adapter-types), or train with --adapter lora"
        )
    if unknown:
        raise LoraFormatError(
            f"LoRA file {path} has tensors of a layout xeonsd does not know, e.g. {unknown[0]!r} "
            "(expected the diffusers layout `unet.<module>.lora.down.weight` or kohya's `lora_unet_<module>.lora_down.weight`)"
        )
    if not modules:
        raise LoraFormatError(f"LoRA file {path} holds no LoRA tensors")
    for mod in modules.values():
        _check_pair(path, mod)
    if lora_flux.is_kohya_flux(list(modules)):
        return _from_kohya_flux(path, modules)
    return modules


def _from_kohya_flux(path: Path, modules: dict[str, LoraModule]) -> dict[str, LoraModule]:
    """A FLUX.1 kohya file's BFL layers as the transformer's diffusers modules (fused layers split)."""
    out: dict[str, LoraModule] = {}
    unet = PREFIXES["unet"]
    for mod in modules.values():
        if not mod.name.startswith(unet):
            out[mod.name] = mod
            continue
        parts = lora_flux.from_kohya(mod.name[len(unet) :], (mod.down, mod.up, mod.scale))  # type: ignore[arg-type]
        if not parts:
            raise LoraFormatError(f"LoRA file {path}: {mod.name} is not a module of FLUX.1's kohya layout")
        for module, (down, up, scale) in parts.items():
            name = kohya_name("transformer", module)
            out[name] = LoraModule(name, f"transformer.{module}", down, up, alpha=scale * down.shape[0])
    return out


def _check_pair(path: Path, mod: LoraModule) -> None:
    if mod.down is None or mod.up is None:
        raise LoraFormatError(f"LoRA file {path}: {mod.label} has no {'down' if mod.down is None else 'up'} matrix")
    if mod.down.ndim != mod.up.ndim or mod.down.ndim not in (2, 4) or mod.up.shape[1] != mod.down.shape[0]:
        raise LoraFormatError(
            f"LoRA file {path}: {mod.label} has down {list(mod.down.shape)} and up {list(mod.up.shape)}, "
            "which are not the two matrices of one adapter"
        )


def _listed(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_fits(path: Path, modules: dict[str, LoraModule], weights: dict[str, tuple[int, ...]], model: str) -> None:
    """Refuse an adapter made for another base model: ``weights`` maps kohya names to the model's weight shapes."""
    missing = sorted(m.label for m in modules.values() if m.name not in weights)
    if missing:
        raise LoraFormatError(
            f"LoRA file {path} was made for another base model than {model}: that model has no module "
            f"{_listed(missing)}"
        )
    for mod in sorted(modules.values(), key=lambda m: m.name):
        have = weights[mod.name]
        want = (int(mod.up.shape[0]), int(mod.down.shape[1]))  # type: ignore[union-attr]
        if tuple(have[:2]) != want or (len(have) == 4 and mod.down.ndim == 4 and have[2:] != mod.down.shape[2:]):  # type: ignore[union-attr]
            raise LoraFormatError(
                f"LoRA file {path} was made for another base model than {model}: {mod.label} is "
                f"{'x'.join(map(str, have))} there, the adapter expects {'x'.join(map(str, want))}"
            )


def _weights(unet, text_encoder, text_encoder_2, **more) -> Iterator[tuple[str, str, Any]]:
    """(component, module, weight) of every weight of a UNet and text encoder(s); ``transformer=``, the denoiser of
    FLUX.1 and SD3 (pass ``unet=None``)."""
    parts = (("unet", unet), ("text_encoder", text_encoder), ("text_encoder_2", text_encoder_2), *more.items())
    for component, model in parts:
        if model is not None:
            for key, value in model.state_dict().items():
                if key.endswith(".weight"):
                    yield component, key[: -len(".weight")], value


def torch_weight_shapes(unet, text_encoder, text_encoder_2=None, **more) -> dict[str, tuple[int, ...]]:
    """Kohya name -> weight shape of a diffusers pipeline's denoiser and text encoder(s)."""
    return {kohya_name(c, m): tuple(w.shape) for c, m, w in _weights(unet, text_encoder, text_encoder_2, **more)}


def module_names(unet, text_encoder, text_encoder_2=None, **more) -> dict[str, str]:
    """Kohya name -> dotted module name (``unet.down_blocks.0…``) of every weight of the denoiser and text
    encoder(s)."""
    return {kohya_name(c, m): f"{c}.{m}" for c, m, _ in _weights(unet, text_encoder, text_encoder_2, **more)}


def lora_family(modules: dict[str, LoraModule]) -> tuple[FamilySpec, str] | None:
    """The family an adapter was made for, read from its module names and shapes, with the evidence; None when
    they do not tell. Each family answers through its spec: among the families of the adapter's denoiser (a
    transformer or a UNet), the first whose ``lora_marks`` match one of its module names (FLUX.1: single-stream
    blocks; SD3: a second CLIP text encoder beside a transformer; SDXL: a second text encoder, attention in the
    UNet's first up block; SD 1.x/2.x: attention in the first down block), else the one whose ``text_widths`` hold
    the width of its cross-attention's key/value input."""
    names = list(modules)
    denoiser = "transformer" if any(n.startswith(PREFIXES["transformer"]) for n in names) else "unet"
    candidates = [s for s in REGISTRY if s.denoiser == denoiser]
    for found in candidates:
        for pattern, evidence in found.lora_marks:
            if any(re.search(pattern, n) for n in names):
                return found, evidence
    for mod in modules.values():
        if re.search(r"_attn2_to_[kv]$", mod.name) and mod.down is not None:
            width = int(mod.down.shape[1])
            found = next((s for s in candidates if width in s.text_widths), None)
            if found is not None:
                return found, f"its cross-attention takes {width}-wide text features"
    return None


def shares_adapters(a: FamilySpec, b: FamilySpec) -> bool:
    """Whether adapters of ``a`` apply to ``b``: one denoiser class, and one of them says its adapters are that
    denoiser's (``FamilySpec.shared_adapters``: FLUX.1 Kontext's are FLUX.1's; SD and SDXL share a UNet class, not
    adapters)."""
    return a.denoiser_class == b.denoiser_class and (a.shared_adapters or b.shared_adapters)


def check_family(path: Path, modules: dict[str, LoraModule], family: FamilySpec, model: str) -> None:
    """Refuse an adapter made for another family (SD 1.x/2.x, SDXL, FLUX.1, SD3), naming both; an adapter of a
    UNet given to a transformer model (or the reverse) is refused even where its exact family does not show.
    A family built on another's denoiser (FLUX.1 Kontext on FLUX.1's transformer) takes its adapters
    (:func:`shares_adapters`)."""
    found = lora_family(modules)
    other = "transformer" if family.denoiser == "unet" else "unet"
    if found is None and any(n.startswith(PREFIXES[other]) for n in modules):
        of_kind = " or ".join(s.label for s in REGISTRY if s.denoiser == other)
        label = f"a {'UNet' if other == 'unet' else 'transformer'} model ({of_kind})"
        evidence = f"it adapts the {other}"
    elif found is not None and found[0] is not family and not shares_adapters(found[0], family):
        label, evidence = found[0].label, found[1]
    else:
        return
    raise LoraFormatError(
        f"LoRA file {path} was made for {label} ({evidence}), and {model} is "
        f"{family.label}; use an adapter trained on a model of that family"
    )


def save_tensors(tensors: dict[str, np.ndarray], out: Path, metadata: dict[str, str]) -> Path:
    """Write ``tensors`` to the safetensors file ``out`` atomically (its folder made where missing)."""
    from safetensors.numpy import save_file

    from xeonsd.fsutil import atomic_path

    with atomic_path(Path(out)) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return Path(out)


def kohya_file_name(name: str, sdxl: bool) -> str:
    """A module's name in a kohya file: SDXL's first text encoder is ``lora_te1_`` there (``lora_te_`` in memory)."""
    te = PREFIXES["text_encoder"]
    return SDXL_TE1_PREFIX + name[len(te) :] if sdxl and name.startswith(te) else name


def write_kohya_flux(modules: dict[str, LoraModule], out: Path, source: str = "") -> Path:
    """A FLUX.1 adapter in the kohya layout ComfyUI and Forge load: the transformer's modules under BFL's names
    (``lora_unet_double_blocks_N_img_attn_qkv`` …, query/key/value fused, see :mod:`xeonsd.modelfiles.lora_flux`),
    CLIP-L's as ``lora_te1_``."""
    prefix = PREFIXES["transformer"]
    transformer = {m.module[len("transformer.") :]: m for m in modules.values() if m.name.startswith(prefix)}  # type: ignore[index]
    try:
        layers = lora_flux.to_kohya({k: (m.down, m.up, m.scale) for k, m in transformer.items()})  # type: ignore[misc]
    except KeyError as exc:
        raise LoraFormatError(f"LoRA file {source}: {exc.args[0]} has no name in FLUX.1's kohya layout") from exc
    out_modules = {m.name: m for m in modules.values() if not m.name.startswith(prefix)}
    for name, (down, up, scale) in layers.items():
        full = PREFIXES["unet"] + name
        out_modules[full] = LoraModule(full, None, down, up, alpha=scale * down.shape[0])
    return write_kohya(out_modules, out, source, sdxl_names=True)


def write_kohya_for(family: FamilySpec | None) -> Callable[[dict[str, LoraModule], Path, str], Path]:
    """The kohya writer of ``family`` (None: SD 1.x/2.x or SDXL, read from the adapter), as its spec's ``kohya``
    says: one function per layout, what the trainer's ``--save_format kohya`` and the converters call. SD3 and the
    Qwen-text families have none: ComfyUI and Forge load their adapters in diffusers' layout."""
    found = family
    if found is not None and found.kohya == "bfl":
        return write_kohya_flux
    if found is not None and found.kohya is None:
        raise LoraFormatError(
            f"--save_format kohya: {found.label} has no kohya layout; ComfyUI and Forge load its adapters in "
            "diffusers' layout (the default)"
        )
    return lambda modules, out, source="": write_kohya(
        modules, out, source, sdxl_names=None if found is None else found.kohya_te_numbered
    )


def write_kohya(modules: dict[str, LoraModule], out: Path, source: str = "", sdxl_names: bool | None = None) -> Path:
    """The SD 1.x/2.x or SDXL adapter in the kohya layout (fp32, alpha = rank where it had none), with kohya's
    dim/alpha metadata when every module shares them. ``sdxl_names``: the text encoders as ``lora_te1_``/``lora_te2_``
    (SDXL's); None: when :func:`lora_family` reads the adapter as SDXL's; False: ``lora_te_`` (SD 1.x/2.x, and what
    GenAI applies)."""
    if sdxl_names is None:
        found = lora_family(modules)
        sdxl_names = found is not None and found[0].kohya_te_numbered
    tensors: dict[str, np.ndarray] = {}
    for mod in modules.values():
        name = kohya_file_name(mod.name, sdxl_names)
        tensors[f"{name}.lora_down.weight"] = np.ascontiguousarray(mod.down, dtype=np.float32)
        tensors[f"{name}.lora_up.weight"] = np.ascontiguousarray(mod.up, dtype=np.float32)
        tensors[f"{name}.alpha"] = np.array(mod.scale * mod.rank, dtype=np.float32)
    metadata = {"format": "pt", "source": json.dumps(source)}
    ranks = {m.rank for m in modules.values()}
    alphas = {m.scale * m.rank for m in modules.values()}
    if len(ranks) == 1 and len(alphas) == 1:
        metadata.update(ss_network_module="networks.lora", ss_network_dim=str(ranks.pop()))
        metadata["ss_network_alpha"] = f"{alphas.pop():g}"
    return save_tensors(tensors, out, metadata)


def write_diffusers(modules: dict[str, LoraModule], out: Path, names: dict[str, str], path: Path) -> Path:
    """The adapter in the diffusers layout ``load_lora_weights`` reads; ``names`` (:func:`module_names`) turns
    kohya names back into modules. Each module's alpha/rank is folded into its up matrix (no alpha written)."""
    lacking = sorted(m.name for m in modules.values() if m.module is None and m.name not in names)
    if lacking:
        raise LoraFormatError(f"LoRA file {path} has modules the model lacks: {_listed(lacking)}")
    tensors: dict[str, np.ndarray] = {}
    for mod in modules.values():
        module = mod.module or names[mod.name]
        down, up = f"{module}.lora_A.weight", f"{module}.lora_B.weight"  # peft's names: the transformers' loaders
        if not module.startswith("transformer."):
            part = "lora_linear_layer" if module.startswith(("text_encoder.", "text_encoder_2.")) else "lora"
            down, up = f"{module}.{part}.down.weight", f"{module}.{part}.up.weight"
        tensors[down] = np.ascontiguousarray(mod.down, dtype=np.float32)
        tensors[up] = np.ascontiguousarray(np.asarray(mod.up) * mod.scale, dtype=np.float32)
    return save_tensors(tensors, out, {"format": "pt"})


def convert(
    path: Path, out: Path, layout: str, names: dict[str, str] | None = None, family: FamilySpec | None = None
) -> Path:
    """Write the adapter file ``path`` to ``out`` in ``layout`` (``kohya``, or ``diffusers`` with ``names``);
    ``family`` (``sd``/``sdxl``/``flux``, None: SD or SDXL read from the adapter) chooses the kohya writer."""
    if layout == "kohya":
        return write_kohya_for(family)(read_adapter(path), out, str(path))
    modules = read_adapter(path)
    if layout == "diffusers":
        return write_diffusers(modules, out, names or {}, path)
    raise LoraFormatError(f"unknown LoRA layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
