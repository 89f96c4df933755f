"""Resumable checkpoints: ``checkpoint-<step>/`` with the trainable state, written atomically.

The sampling plan depends only on the seed and the global example index, so step, seed, the method's trainable
state, optimizer and lr-scheduler state are everything a resumed run needs to continue the same trajectory. A
checkpoint also names its method and base model, so that one is never resumed onto another.
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
    """``latest`` → the newest checkpoint in ``out_dir`` (refused when there is none); ``latest_if_any`` → the
    newest, or None (a new run); a path must hold a checkpoint."""
    if arg in ("latest", "latest_if_any"):
        found = list_checkpoints(out_dir)
        if found:
            return found[-1][1]
        if arg == "latest_if_any":
            return None
        raise CheckpointError(
            f"--resume_from_checkpoint latest: {out_dir} holds no checkpoint to resume from; start a new run without "
            "--resume_from_checkpoint, or pass latest_if_any to start one when there is no checkpoint"
        )
    path = Path(arg)
    if not path.is_absolute() and not path.exists():
        path = Path(out_dir) / arg
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"--resume_from_checkpoint {arg}: no checkpoint there (expected {path / STATE_FILE})")
    return path


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step}"


def save_checkpoint(out_dir: Path, step: int, state: dict, keep: int | None = None) -> Path:
    target = Path(out_dir) / checkpoint_name(step)
    with atomic_dir(target, overwrite=True) as tmp:
        torch.save(state, tmp / STATE_FILE)
    if keep is not None and keep > 0:
        for _, old in list_checkpoints(out_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return target


def load_checkpoint(path: Path) -> dict:
    try:
        state = torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - truncated or foreign files raise many kinds of errors
        raise CheckpointError(f"checkpoint {path} is unreadable: {exc}") from exc
    if "method" not in state:  # written before the trainer had methods: textual inversion, state at the top
        state = {
            **state,
            "method": "textual_inversion",
            "base_model": None,
            "method_state": {"vectors": state["vectors"], "placeholder_tokens": state["placeholder_tokens"]},
        }
    return state


def check_belongs(state: dict, where: Path, method: str, base_model: str) -> None:
    """Refuse a checkpoint of another method or another base model."""
    if state["method"] != method:
        raise CheckpointError(
            f"checkpoint {where} is a {state['method']} run's; this run is --method {method}. Resume it with "
            f"--method {state['method']}, or start a new run in another --output_dir"
        )
    if state.get("base_model") not in (None, base_model):
        raise CheckpointError(
            f"checkpoint {where} was trained on another base model (fingerprint {state['base_model']}, this "
            f"--pretrained_model_name_or_path is {base_model}); resume it with the model it was trained on"
        )
