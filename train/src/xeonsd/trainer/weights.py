"""Frozen models read straight into the training dtype, one tensor at a time.

``from_pretrained(torch_dtype=bf16)`` reads a whole fp32 safetensors file first and casts it afterwards: for SD
1.5's UNet that is 3.4 GB of fp32 beside the 1.7 GB bf16 copy, and this load, not the training, was the peak memory
of textual inversion and LoRA. Here the model is built on the ``meta`` device (no memory), and each tensor is read
from the file with a plain read (not a memory map, whose touched pages count as resident until it is closed),
cast, and assigned: the peak is the model in its dtype plus the largest single tensor in the file's dtype.

Only local safetensors weights are read this way (a model directory, or a Hub id already in the local cache);
anything else (``.bin`` weights, a model still on the Hub) goes through ``from_pretrained`` as before.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
WEIGHTS_NAME = "diffusion_pytorch_model"


class WeightsFileError(ValueError):
    """A safetensors file that cannot be read as one."""


def _read_header(f, path: Path) -> tuple[dict, int]:
    """A safetensors file's tensor table (without ``__metadata__``) and the offset its data starts at."""
    try:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    except (struct.error, ValueError) as exc:
        raise WeightsFileError(f"{path}: not a safetensors file ({exc})") from exc
    header.pop("__metadata__", None)
    return header, 8 + size


def read_safetensors(path: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path``, floating-point ones cast to ``dtype`` (None: as stored),
    reading one tensor at a time."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensor_reader([path]):
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        out[name] = t
    return out


def tensor_reader(files: list[Path]):
    """(name, tensor as stored) for every tensor of these safetensors files, one plain read at a time, in the
    order they lie in each file."""
    for path in files:
        with open(path, "rb") as f:
            header, start = _read_header(f, path)
            for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                stored = _stored_dtype(path, name, info)
                begin, end = info["data_offsets"]
                f.seek(start + begin)
                buf = bytearray(end - begin)
                if f.readinto(buf) != len(buf):
                    raise WeightsFileError(f"{path}: the file ends inside tensor {name!r} (truncated?)")
                t = torch.frombuffer(buf, dtype=stored) if buf else torch.empty(0, dtype=stored)
                yield name, t.reshape(info["shape"])


def read_tensor_table(files: list[Path]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Each tensor's stored dtype and shape in these safetensors files, from their headers alone."""
    table = {}
    for path in files:
        with open(path, "rb") as f:
            header, _ = _read_header(f, path)
        for name, info in header.items():
            table[name] = (_stored_dtype(path, name, info), tuple(info["shape"]))
    return table


def _stored_dtype(path: Path, name: str, info: dict) -> torch.dtype:
    stored = DTYPES.get(info.get("dtype"))
    if stored is None:
        raise WeightsFileError(f"{path}: tensor {name!r} has the unsupported dtype {info.get('dtype')!r}")
    return stored


def largest_tensor_bytes(files: list[Path]) -> int:
    """The bytes of the largest tensor in these safetensors files, as stored (read from their headers)."""
    table = read_tensor_table(files).values()
    return max((dtype.itemsize * math.prod(shape) for dtype, shape in table), default=0)


def local_weight_files(
    src: str, subfolder: str, variant: str | None, revision: str | None, weights_name: str = WEIGHTS_NAME
) -> list[Path] | None:
    """The safetensors files of ``src``'s ``subfolder`` on this machine (one, or a sharded set), or None.
    ``weights_name``: the files' stem (diffusers' ``diffusion_pytorch_model``, transformers' ``model``)."""
    folder = Path(src).expanduser() / subfolder
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(src, revision=revision, local_files_only=True)) / subfolder
        except Exception:  # not in the local cache, or not a Hub id: from_pretrained decides
            return None
    stem = weights_name if variant is None else f"{weights_name}.{variant}"
    single = folder / f"{stem}.safetensors"
    if single.is_file():
        return [single]
    index = folder / f"{stem}.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    return None


def empty_model(model_cls, src: str, subfolder: str, revision: str | None):
    """``model_cls`` (a diffusers model, or a transformers one) built from ``src``/``subfolder``'s config with its
    parameters on the meta device: no memory, for the weights to be assigned (``load_state_dict(assign=True)``).
    Buffers and plain tensor attributes are real (Qwen-Image's RoPE tables are plain attributes that no state dict
    sets: under ``torch.device("meta")`` they stayed meta)."""
    from accelerate import init_empty_weights

    if hasattr(model_cls, "load_config"):  # diffusers
        config = model_cls.load_config(src, subfolder=subfolder, revision=revision)
        with init_empty_weights(include_buffers=False):
            model = model_cls.from_config(config)
        model.register_to_config(_name_or_path=src)  # as from_pretrained records it
        return model
    config = model_cls.config_class.from_pretrained(src, subfolder=subfolder, revision=revision)
    with init_empty_weights(include_buffers=False):
        return model_cls._from_config(config)


def load_frozen(model_cls, src: str, subfolder: str, dtype: torch.dtype, variant: str | None, revision: str | None):
    """``model_cls`` (a diffusers model) from ``src``/``subfolder`` with its weights in ``dtype``: read tensor by
    tensor where the weights are local safetensors whose names fit the model, else through ``from_pretrained``."""
    files = local_weight_files(src, subfolder, variant, revision)
    if files is None:
        return model_cls.from_pretrained(
            src, subfolder=subfolder, variant=variant, revision=revision, torch_dtype=dtype
        )
    model = empty_model(model_cls, src, subfolder, revision)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(read_safetensors(f, dtype))
    model_keys = set(model.state_dict())
    if model_keys != state.keys():  # e.g. an old checkpoint's key names, which from_pretrained converts
        log.info("%s/%s: the weights' names differ from the model's; loading through from_pretrained", src, subfolder)
        del state
        return model_cls.from_pretrained(
            src, subfolder=subfolder, variant=variant, revision=revision, torch_dtype=dtype
        )
    model.load_state_dict(state, assign=True)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise WeightsFileError(f"{files[0].parent}: {model_cls.__name__} has tensors the weights do not set")
    model.eval()
    log.debug("read %s/%s tensor by tensor in %s", src, subfolder, dtype)
    return model
