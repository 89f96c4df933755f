"""Resumable checkpoints: ``checkpoint-<step>/`` with the trainable state, written atomically.

The sampling plan depends only on the seed and the global example index, so step, seed, trainable vectors,
optimizer and lr-scheduler state are everything a resumed run needs to continue the same trajectory.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import torch

from xeonsd.fsutil import atomic_dir

log = logging.getLogger(__name__)

_NAME = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.pt"


class CheckpointError(ValueError):
    """A checkpoint to resume from is missing or does not belong to this run."""


def list_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = []
    for p in out_dir.iterdir():
        m = _NAME.match(p.name)
        if m and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def resolve_resume(arg: str, out_dir: Path) -> Path | None:
    """``latest`` → newest checkpoint in ``out_dir`` (None if there is none yet); a path must exist."""
    if arg == "latest":
        found = list_checkpoints(out_dir)
        return found[-1][1] if found else None
    path = Path(arg)
    if not path.is_absolute() and not path.exists():
        path = Path(out_dir) / arg
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"--resume_from_checkpoint {arg}: no checkpoint there (expected {path / STATE_FILE})")
    return path


def save_checkpoint(out_dir: Path, step: int, state: dict, keep: int | None = None) -> Path:
    target = Path(out_dir) / f"checkpoint-{step}"
    with atomic_dir(target, overwrite=True) as tmp:
        torch.save(state, tmp / STATE_FILE)
    if keep is not None and keep > 0:
        for _, old in list_checkpoints(out_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return target


def load_checkpoint(path: Path) -> dict:
    return torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=False)
