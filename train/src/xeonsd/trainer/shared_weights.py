"""Frozen weights that a node's ranks share: one node-local file per component, mapped read-only by every rank.

With LoRA and textual inversion the denoiser, the VAE and the text encoders never change, and every rank of a node
used to read its own copy of them (4 ranks of a FLUX.1 LoRA: about 97 GB of identical bytes). Here each frozen
component is written once per node, in the training dtype and memory layout, into a file under
``--shared_weights_dir`` (a tmpfs by default), and every rank maps that file read-only and shared
(``PROT_READ``, ``MAP_SHARED``): the kernel holds its pages once per node, and the sum of the ranks' PSS shows it.

- Nothing copies the weights on access: they are stored in the dtype and the strides the trainer uses (channels
  last included), so loading assigns the mapped tensors as they are. A rank that writes to one (an in-place op on
  a frozen weight) is killed by SIGSEGV at that line (faulthandler prints where): the shared copy is never changed
  behind the other ranks' backs, and no rank is silently given a private copy.
- The first rank that needs a component builds its file (one tensor at a time from the model's safetensors,
  cast and laid out as it goes) under an exclusive ``flock``, writes it under a temporary name and renames it into
  place; the others wait on the lock and map the result. It works the same under mpirun, Slurm or two jobs started
  on the same base: the lock and the rename are all the coordination there is.
- A file is checked before it is mapped: its magic, its key (the component's fingerprint, dtype and layout) and
  its size. A truncated or stale file is rebuilt.
- Each job holds a shared ``flock`` on the directory's ``users`` file while it runs; the rank that ends last (its
  exclusive lock succeeds) removes the directory, unless ``--keep_shared_weights``.

The file: 8 bytes of magic, a little-endian u64 header length, the JSON header (key; each tensor's dtype, shape,
strides and offset; tied names), then the data from the next 4 KiB boundary, each tensor 64-byte aligned.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from xeonsd.trainer.weights import _DTYPES, WeightsFileError, read_tensor_table, tensor_reader

log = logging.getLogger("xeonsd.train")
MAGIC = b"XSDSW01\0"
_PAGE = 4096
_ALIGN = 64
_NAMES = {v: k for k, v in _DTYPES.items()}


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
        n: {"dtype": _NAMES[p.dtype], "shape": list(p.shape), "stride": list(p.stride), "offset": p.offset}
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
            dtype, shape, stride = _DTYPES[info["dtype"]], tuple(info["shape"]), tuple(info["stride"])
            count = _storage_numel(shape, stride)
            if count == 0:
                out[name] = torch.empty(shape, dtype=dtype)
                continue
            flat = torch.frombuffer(mm, dtype=dtype, count=count, offset=start + info["offset"])
            out[name] = flat.as_strided(shape, stride)
    for alias, name in doc["aliases"].items():
        out[alias] = out[name]
    return out


@dataclass
class Component:
    """How to build one frozen component: an empty model (parameters on meta) that the mapped tensors are assigned
    to, its weight files (None: not local safetensors), the dtype its floating tensors are kept in, and a loader
    of the whole model in that dtype for when the files' names do not fit the model (old checkpoints)."""

    name: str
    empty: Callable[[], torch.nn.Module]
    files: list[Path] | None
    dtype: torch.dtype
    load_whole: Callable[[], torch.nn.Module]
    fingerprint: str
    channels_last: bool = False

    def key(self) -> dict:
        return {
            "component": self.name,
            "fingerprint": self.fingerprint,
            "dtype": _NAMES[self.dtype],
            "channels_last": self.channels_last,
        }


def _tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Names of the model's state that are the same tensor as another name (tied weights): name -> first name."""
    first: dict[int, str] = {}
    aliases = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(t) in first:
            aliases[name] = first[id(t)]
        else:
            first[id(t)] = name
    state = model.state_dict(keep_vars=True)
    return {a: n for a, n in aliases.items() if a in state}


def _kept_dtype(stored: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    return dtype if stored.is_floating_point else stored


def _build(path: Path, comp: Component, model: torch.nn.Module) -> None:
    """Write ``comp``'s file at ``path``: streamed from its safetensors when their names fit the model, else from
    the whole model loaded through ``load_whole``."""
    key = comp.key()
    state_names = set(model.state_dict(keep_vars=True))
    aliases = _tied_aliases(model)
    if comp.files is not None:
        table = read_tensor_table(comp.files)
        names = set(table)
        dropped = {a: n for a, n in aliases.items() if a not in names and n in names}
        if names | set(dropped) == state_names and not (names & set(dropped)):
            shapes = {n: (_kept_dtype(dt, comp.dtype), shape) for n, (dt, shape) in table.items()}
            planned, data = plan(shapes, comp.channels_last)
            write_file(path, key, planned, dropped, data, tensor_reader(comp.files))
            return
        log.info("%s: the weights' names differ from the model's; building its shared file from the model", comp.name)
    whole = comp.load_whole()
    state = whole.state_dict()
    aliases = {a: n for a, n in _tied_aliases(whole).items() if a in state}
    shapes = {n: (_kept_dtype(t.dtype, comp.dtype), tuple(t.shape)) for n, t in state.items() if n not in aliases}
    planned, data = plan(shapes, comp.channels_last)
    write_file(path, key, planned, aliases, data, ((n, t) for n, t in state.items() if n not in aliases))


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, mode)
        yield fd
    finally:
        os.close(fd)


@dataclass
class SharedStore:
    """One base model's frozen components on this node, under ``root``/``base``; open for one job's lifetime
    (:func:`open_store`)."""

    directory: Path
    keep: bool
    _users_fd: int | None = None
    mapped: dict[str, int] = field(default_factory=dict)  # component -> bytes mapped

    def load(self, comp: Component) -> torch.nn.Module:
        """``comp`` with its tensors mapped from the node's file (built first when missing, truncated or stale)."""
        path = self.directory / f"{comp.name.replace('/', '_')}.weights"
        model = comp.empty()
        with _flock(self.directory / f".{path.name}.lock", fcntl.LOCK_EX):
            found = read_header(path)
            if found is None or found[0]["key"] != comp.key():
                if path.exists():
                    log.warning("%s: incomplete or stale shared weights; building them again", path)
                t0 = time.perf_counter()
                _build(path, comp, model)
                found = read_header(path)
                if found is not None:
                    log.info(
                        "built %s (%.3f GB) in %.1f s", path, found[0]["data_bytes"] / 1e9, time.perf_counter() - t0
                    )
                if found is None:
                    raise SharedWeightsError(f"{path}: the file just written does not read back")
        doc, start = found
        state = map_file(path, doc, start)
        model.load_state_dict(state, assign=True, strict=True)
        model.requires_grad_(False)
        model.eval()
        self.mapped[comp.name] = doc["data_bytes"]
        return model

    def close(self) -> None:
        """This job no longer uses the directory: the last job to leave removes it (unless kept)."""
        if self._users_fd is None:
            return
        os.close(self._users_fd)
        self._users_fd = None
        if self.keep:
            return
        with _flock(self.directory.with_name(f".{self.directory.name}.lock"), fcntl.LOCK_EX):
            users = self.directory / "users"
            try:
                fd = os.open(users, os.O_RDWR)
            except FileNotFoundError:
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # another job (or another rank of this one) still maps it
            finally:
                os.close(fd)
            gone = self.directory.with_name(f".{self.directory.name}.gone-{os.getpid()}")
            os.replace(self.directory, gone)
            shutil.rmtree(gone, ignore_errors=True)
            log.info("removed the shared weights %s (no job uses them now)", self.directory)


def base_directory_name(src: str, fingerprint: str) -> str:
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(src.rstrip("/")).name)[:40] or "model"
    return f"{stem}-{hashlib.sha256(fingerprint.encode()).hexdigest()[:16]}"


@contextlib.contextmanager
def open_store(root: Path, src: str, fingerprint: str, keep: bool) -> Iterator[SharedStore]:
    """The node's store for the base ``src`` (``fingerprint``: :func:`xeonsd.modelfiles.modelsource.model_fingerprint`)
    under ``root``, held open (a shared lock on its ``users`` file) until the block ends."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SharedWeightsError(f"cannot make the shared weights directory {root}: {exc}") from exc
    directory = root / base_directory_name(src, fingerprint)
    with _flock(root / f".{directory.name}.lock", fcntl.LOCK_EX):
        directory.mkdir(exist_ok=True)
        fd = os.open(directory / "users", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
    store = SharedStore(directory, keep, fd)
    try:
        yield store
    finally:
        store.close()


def shares_weights(share_weights: str, local_world_size: int) -> bool:
    """Whether a rank maps the frozen weights from the node's file: ``--share_weights on``, or ``auto`` when the
    node runs more than one of the job's ranks."""
    return share_weights == "on" or (share_weights == "auto" and local_world_size > 1)


def open_for_job(cfg, local_world_size: int) -> contextlib.AbstractContextManager[SharedStore | None]:
    """The job's store (None when this rank loads private copies: :func:`shares_weights`)."""
    if not shares_weights(cfg.share_weights, local_world_size):
        return contextlib.nullcontext()
    from xeonsd.modelfiles.modelsource import model_fingerprint

    fingerprint = model_fingerprint(cfg.pretrained_model_name_or_path, cfg.revision)
    return open_store(
        Path(cfg.shared_weights_dir), cfg.pretrained_model_name_or_path, fingerprint, cfg.keep_shared_weights
    )
