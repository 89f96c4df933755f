"""xeonsd_train_argv: the `xeonsd train` argument list of the chosen method, from the inventory's flags.

inventory/group_vars/all/finetune.yml names every flag once, grouped like `xeonsd train --help` (``all`` for
every method, then one group per method). `xeonsd train` refuses a flag of another method than ``--method``, so
the list carries ``--method`` first, then the flags of ``all`` and of that method only; finetune.yml's job and
doctor.yml's one-step trial both use it.

A value of true is the bare flag, false/None/"" leaves the flag out (the trainer's default), anything else is
``--name=value``.

xeonsd_method: what a method leaves in the run directory (its result file, what people call it, whether it is a
whole pipeline, its `xeonsd generate` flag); xeonsd_generate_result_args: those generate arguments for a run.

The methods and their files are defined once, in the package's ``train/src/xeonsd/contracts/method_names.py``
(standard library only), which this plugin loads from the repository on the controller.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# xeonsd's contracts (train/src/xeonsd/contracts: standard library only) from this repository's source tree.
_SRC = str(Path(__file__).resolve().parents[2] / "train" / "src")
if _SRC not in sys.path:
    sys.path.insert(0, _SRC)
from xeonsd.contracts import method_names  # noqa: E402

METHODS: tuple[str, ...] = method_names.METHODS
METHOD_FILES: dict[str, dict] = method_names.METHOD_FILES


class TrainArgvError(ValueError):
    """A method or flag group the trainer does not know."""


def _flag(name: str, value: Any) -> list[str]:
    if value is True:
        return [f"--{name}"]
    if value is False or value is None or value == "":
        return []
    return [f"--{name}={value}"]


def train_argv(flags: Mapping[str, Mapping[str, Any]], method: str, extra: Sequence[str] = ()) -> list[str]:
    """``["--method=M", <flags of all>, <flags of M>, *extra]``."""
    if method not in METHODS:
        raise TrainArgvError(f"finetune_method {method!r}: choose one of {', '.join(METHODS)}")
    unknown = sorted(set(flags) - {"all", *METHODS})
    if unknown:
        raise TrainArgvError(
            f"finetune_train_flags: unknown group(s) {', '.join(unknown)}; groups: all, " + ", ".join(METHODS)
        )
    argv = [f"--method={method}"]
    for group in ("all", method):
        for name, value in (flags.get(group) or {}).items():
            argv += _flag(name, value)
    return argv + [str(a) for a in extra]


def method(name: str) -> dict:
    """``{"name", "result", "what", "pipeline", "generate_flag"}`` of the method ``name``."""
    if name not in METHODS:
        raise TrainArgvError(f"finetune_method {name!r}: choose one of {', '.join(METHODS)}")
    return {"name": name, **METHOD_FILES[name]}


def generate_result_args(summary: Mapping[str, Any], run_dir: str, lora_scale: Any = 1.0) -> list[str]:
    """The `xeonsd generate` arguments that load a run's result (train_summary.json names its method and result
    file) onto the base model's export: ``--embeds FILE``, ``--lora FILE:SCALE``, or none (a whole pipeline)."""
    flag = method(summary["method"])["generate_flag"]
    if flag is None:
        return []
    path = f"{run_dir}/{summary['result']['path']}"
    return [flag, f"{path}:{lora_scale}" if flag == "--lora" else path]


class FilterModule:
    def filters(self) -> dict:
        return {
            "xeonsd_train_argv": train_argv,
            "xeonsd_method": method,
            "xeonsd_generate_result_args": generate_result_args,
        }
