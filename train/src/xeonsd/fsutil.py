"""Crash-safe output: everything is written under a temporary name and renamed into place at the end."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


class OutputExistsError(FileExistsError):
    """The output path is already taken by something we must not overwrite."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _check_writable_parent(path: Path) -> None:
    parent = path.parent
    parent.mkdir(parents=True, exist_ok=True)
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"cannot write to {parent}: directory is not writable")


@contextlib.contextmanager
def atomic_dir(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside ``out``; rename it to ``out`` when the block succeeds.

    On error the temporary directory is removed and ``out`` is untouched. An existing non-empty ``out`` is
    refused unless ``overwrite`` is set, in which case it is replaced only after the new one is complete.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputExistsError(f"{out} already exists and is not empty; remove it or choose another path")
    _check_writable_parent(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; the result should look like any other directory
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` for a writer that takes a file name (e.g. safetensors, PIL);
    ``os.replace`` it onto ``path`` when the block succeeds, remove it when it fails."""
    path = Path(path)
    _check_writable_parent(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    os.chmod(tmp_name, 0o666 & ~_umask())
    try:
        yield Path(tmp_name)
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "wb") -> Iterator:
    """:func:`atomic_path` opened for writing (``mode``), flushed to disk before the rename."""
    with atomic_path(path) as tmp, open(tmp, mode) as fh:
        yield fh
        fh.flush()
        os.fsync(fh.fileno())
