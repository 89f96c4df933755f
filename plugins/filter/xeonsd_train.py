"""xeonsd_train_argv: the `xeonsd train` argument list of the chosen method, from the inventory's flags.

inventory/group_vars/all/finetune.yml names every flag once, grouped like `xeonsd train --help` (``all`` for
every method, then one group per method). `xeonsd train` refuses a flag of another method than ``--method``, so
the list carries ``--method`` first, then the flags of ``all`` and of that method only; finetune.yml's job and
doctor.yml's one-step trial both use it.

A value of true is the bare flag, false/None/"" leaves the flag out (the trainer's default), anything else is
``--name=value``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

METHODS = ("textual_inversion", "lora", "full")


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
        raise TrainArgvError(f"finetune_train_flags: unknown group(s) {', '.join(unknown)}; groups: all, "
                             + ", ".join(METHODS))  # fmt: skip
    argv = [f"--method={method}"]
    for group in ("all", method):
        for name, value in (flags.get(group) or {}).items():
            argv += _flag(name, value)
    return argv + [str(a) for a in extra]


class FilterModule:
    def filters(self) -> dict:
        return {"xeonsd_train_argv": train_argv}
