"""The file behind the shared weights (:mod:`xeonsd.trainer.shared_weights`): one frozen component's tensors in their training dtype and strides,
laid out to be mapped read-only (``PROT_READ``, ``MAP_SHARED``) and viewed in place, with no copy.

8 bytes of magic, a little-endian u64 header length, the JSON header (the key it was built for; each tensor's
dtype, shape, strides and offset; tied names), then the data from the next 4 KiB boundary, each tensor 64-byte
aligned. A file is written under a temporary name and renamed when complete; :func:`read_header` accepts only a
complete file (magic, header and size), so a truncated one is rebuilt.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from xeonsd.trainer.weights import DTYPES, WeightsFileError

MAGIC = b"XSDSW01\0"
_PAGE = 4096
_ALIGN = 64
NAMES = {v: k for k, v in DTYPES.items()}


class SharedWeightsError(OSError):
    """The shared weights directory cannot hold a component (no space, not writable)."""


@dataclass(frozen=True)
class Planned:
    """One tensor of a component's file: where it lies and how it is viewed."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return _storage_numel(self.shape, self.stride) * self.dtype.itemsize


def _storage_numel(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))


def layout_stride(shape: tuple[int, ...], channels_last: bool) -> tuple[int, ...]:
    """The strides a tensor of ``shape`` has in the trainer: channels last for 4-D tensors when asked (what
    ``Module.to(memory_format=torch.channels_last)`` gives), else contiguous."""
    fmt = torch.channels_last if channels_last and len(shape) == 4 else torch.contiguous_format
    return tuple(torch.empty(shape, device="meta").contiguous(memory_format=fmt).stride())


def plan(tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]], channels_last: bool) -> tuple[dict, int]:
    """Each tensor's place in the data (64-byte aligned, in name order) and the data's length."""
    out, offset = {}, 0
    for name in sorted(tensors):
        dtype, shape = tensors[name]
        p = Planned(dtype, tuple(shape), layout_stride(tuple(shape), channels_last), offset)
        out[name] = p
        offset += -(-p.nbytes // _ALIGN) * _ALIGN
    return out, offset


def _header_bytes(key: dict, planned: dict[str, Planned], aliases: dict[str, str], data_bytes: int) -> bytes:
    table = {
        n: {"dtype": NAMES[p.dtype], "shape": list(p.shape), "stride": list(p.stride), "offset": p.offset}
        for n, p in planned.items()
    }
    doc = {"key": key, "tensors": table, "aliases": aliases, "data_bytes": data_bytes}
    return json.dumps(doc, sort_keys=True).encode()


def _data_start(header_len: int) -> int:
    return -(-(16 + header_len) // _PAGE) * _PAGE


def write_file(
    path: Path,
    key: dict,
    planned: dict[str, Planned],
    aliases: dict[str, str],
    data_bytes: int,
    tensors: Iterator[tuple[str, torch.Tensor]],
) -> None:
    """Write a component's file at ``path`` (through a temporary name in its directory, renamed when complete):
    ``tensors`` yields (name, tensor) for every planned name, in any order and any dtype or layout; each is cast
    and laid out as planned."""
    header = _header_bytes(key, planned, aliases, data_bytes)
    start = _data_start(len(header))
    _check_space(path, start + data_bytes)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    written: set[str] = set()
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
            f.truncate(start + data_bytes)
            for name, t in tensors:
                p = planned[name]
                t = t.detach().to(p.dtype)
                dense = torch.empty_strided(p.shape, p.stride, dtype=p.dtype)
                dense.copy_(t)
                if p.nbytes:
                    f.seek(start + p.offset)
                    flat = dense.as_strided((_storage_numel(p.shape, p.stride),), (1,))
                    f.write(memoryview(flat.view(torch.uint8).numpy()))
                written.add(name)
            missing = sorted(set(planned) - written)
            if missing:
                raise WeightsFileError(f"{path.name}: no weights for {', '.join(missing[:5])}")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise SharedWeightsError(f"cannot write the shared weights {path}: {exc}") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _check_space(path: Path, needed: int) -> None:
    st = os.statvfs(path.parent)
    free = st.f_bavail * st.f_frsize
    if free < needed:
        raise SharedWeightsError(
            f"the shared weights {path.name} need {needed / 1e9:.2f} GB in {path.parent}, which has "
            f"{free / 1e9:.2f} GB free. Fix: --shared_weights_dir on a filesystem with room (the inventory's "
            "finetune_shared_weights_dir), or --share_weights off"
        )


def read_header(path: Path) -> tuple[dict, int] | None:
    """The file's header and where its data starts, or None when it is not a complete file of ours (a missing,
    foreign or truncated file)."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
            if len(head) != 16 or head[:8] != MAGIC:
                return None
            (size,) = struct.unpack("<Q", head[8:])
            doc = json.loads(f.read(size))
            start = _data_start(size)
            if os.fstat(f.fileno()).st_size != start + doc["data_bytes"]:
                return None
    except (OSError, ValueError, KeyError):
        return None
    return doc, start


def map_file(path: Path, doc: dict, start: int) -> dict[str, torch.Tensor]:
    """Every tensor of the file as a read-only view of one shared mapping (tied names included)."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():  # "The given buffer is not writable": read-only on purpose
        warnings.simplefilter("ignore", UserWarning)
        for name, info in doc["tensors"].items():
            dtype, shape, stride = DTYPES[info["dtype"]], tuple(info["shape"]), tuple(info["stride"])
            count = _storage_numel(shape, stride)
            if count == 0:
                out[name] = torch.empty(shape, dtype=dtype)
                continue
            flat = torch.frombuffer(mm, dtype=dtype, count=count, offset=start + info["offset"])
            out[name] = flat.as_strided(shape, stride)
    for alias, name in doc["aliases"].items():
        out[alias] = out[name]
    return out
