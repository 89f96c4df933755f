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
  exclusive lock succeeds) removes the directory, unless ``--keep_shared_weights``. Each rank holds one on a
  component's ``.NAME.weights.users`` while it maps it: the last rank to drop a component it no longer needs (T5
  once the prompts are encoded, the VAE once the latents are cached) removes that file, so a tmpfs gives its memory
  back during the job.

The file's layout: :mod:`.file`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from xeonsd.trainer.shared_weights.file import (
    NAMES,
    SharedWeightsError,
    map_file,
    plan,
    read_header,
    write_file,
)
from xeonsd.trainer.weights import read_tensor_table, tensor_reader

__all__ = ["Component", "SharedStore", "SharedWeightsError", "open_for_job", "open_store", "shares_weights"]
log = logging.getLogger("xeonsd.train")


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
            "dtype": NAMES[self.dtype],
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
    aliases = _tied_aliases(whole)  # names of whole's state only
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
    _readers: dict[str, int] = field(default_factory=dict)  # component -> its users file (a shared flock) held

    def _path(self, name: str) -> Path:
        return self.directory / f"{name.replace('/', '_')}.weights"

    def load(self, comp: Component) -> torch.nn.Module:
        """``comp`` with its tensors mapped from the node's file (built first when missing, truncated or stale)."""
        path = self._path(comp.name)
        model = comp.empty()
        with _flock(self.directory / f".{path.name}.lock", fcntl.LOCK_EX):
            found = read_header(path)
            if found is None or found[0]["key"] != comp.key():
                if path.exists():
                    log.warning("%s: incomplete or stale shared weights; building them again", path)
                t0 = time.perf_counter()
                _build(path, comp, model)
                found = read_header(path)
                if found is None:
                    raise SharedWeightsError(f"{path}: the file just written does not read back")
                log.info("built %s (%.3f GB) in %.1f s", path, found[0]["data_bytes"] / 1e9, time.perf_counter() - t0)
            if comp.name not in self._readers:  # under the lock: release() cannot remove the file in between
                fd = os.open(self.directory / f".{path.name}.users", os.O_RDWR | os.O_CREAT, 0o644)
                fcntl.flock(fd, fcntl.LOCK_SH)
                self._readers[comp.name] = fd
        doc, start = found
        state = map_file(path, doc, start)
        model.load_state_dict(state, assign=True, strict=True)
        model.requires_grad_(False)
        model.eval()
        self.mapped[comp.name] = doc["data_bytes"]
        return model

    @property
    def held(self) -> dict[str, int]:
        """The components this rank still maps (``mapped`` less those released): component -> bytes."""
        return {name: n for name, n in self.mapped.items() if name in self._readers}

    def release(self, name: str) -> None:
        """This rank dropped its model of component ``name`` (T5 once the prompts are encoded, the VAE once the
        latents are cached): the node's last rank to do so removes the file, so a tmpfs gives its memory back
        (unless kept). A later job on the base builds it again."""
        fd = self._readers.pop(name, None)
        if fd is None:
            return
        os.close(fd)
        path = self._path(name)
        # Ranks let go of their users lock before they take the file's lock: two of them can both find no user
        # left, and the second finds the file already removed by the first.
        if not self.keep and _remove_if_unused(
            self.directory / f".{path.name}.lock", self.directory / f".{path.name}.users", lambda: _unlink(path)
        ):
            log.info("removed %s: no rank of the node maps it any more", path)

    def close(self) -> None:
        """This job no longer uses the directory: the last job to leave removes it (unless kept)."""
        for fd in self._readers.values():
            os.close(fd)
        self._readers.clear()
        if self._users_fd is None:
            return
        os.close(self._users_fd)
        self._users_fd = None
        if self.keep:
            return

        def remove() -> bool:
            gone = self.directory.with_name(f".{self.directory.name}.gone-{os.getpid()}")
            os.replace(self.directory, gone)
            shutil.rmtree(gone, ignore_errors=True)
            return True

        lock = self.directory.with_name(f".{self.directory.name}.lock")
        if _remove_if_unused(lock, self.directory / "users", remove):
            log.info("removed the shared weights %s (no job uses them now)", self.directory)


def _remove_if_unused(lock: Path, users: Path, remove: Callable[[], bool]) -> bool:
    """Under the exclusive ``lock``: when nobody holds ``users`` (its exclusive flock succeeds at once), call
    ``remove``, which says whether there was something to remove. True when it removed something."""
    with _flock(lock, fcntl.LOCK_EX):
        try:
            fd = os.open(users, os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # another job, or another rank of this one, still maps it
        else:
            return remove()
        finally:
            os.close(fd)


def _unlink(path: Path) -> bool:
    """Remove ``path``; False when another rank removed it first."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def base_directory_name(src: str, fingerprint: str) -> str:
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(src.rstrip("/")).name)[:40] or "model"
    return f"{stem}-{hashlib.sha256(fingerprint.encode()).hexdigest()[:16]}"


@contextlib.contextmanager
def open_store(root: Path, src: str, fingerprint: str, keep: bool) -> Iterator[SharedStore]:
    """The node's store for the base ``src`` (``fingerprint``: :func:`xeonsd.modelfiles.modelsource.model_fingerprint`)
    under ``root``, held open (a shared lock on its ``users`` file) until the block ends."""
    directory = root / base_directory_name(src, fingerprint)
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        with _flock(root / f".{directory.name}.lock", fcntl.LOCK_EX):
            directory.mkdir(exist_ok=True)
            fd = os.open(directory / "users", os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError as exc:
        raise SharedWeightsError(
            f"cannot use the shared weights directory {root}: {exc}. Fix: --shared_weights_dir (the inventory's "
            "finetune_shared_weights_dir) naming a node-local directory this account can write, or --share_weights "
            "off"
        ) from exc
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
    root = Path(shared_root(cfg.shared_weights_dir))
    return open_store(root, cfg.pretrained_model_name_or_path, fingerprint, cfg.keep_shared_weights)


def shared_root(template: str) -> str:
    """``--shared_weights_dir`` with ``{uid}`` replaced by this account's user id (the default,
    ``/dev/shm/xeonsd-weights-{uid}``: one directory per account, so a job of another account on the node never
    finds a directory it cannot write)."""
    return template.replace("{uid}", str(os.getuid()))
