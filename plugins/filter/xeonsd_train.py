"""xeonsd_train_argv: the `xeonsd train` argument list of the chosen method, from the inventory's flags.

inventory/group_vars/all/finetune.yml names every flag once, grouped like `xeonsd train --help` (``all`` for
every method, then one group per method). `xeonsd train` refuses a flag of another method than ``--method``, so
the list carries ``--method`` first, then the flags of ``all`` and of that method only; finetune.yml's job and
doctor.yml's one-step trial both use it.

A value of true is the bare flag, false/None/"" leaves the flag out (the trainer's default), anything else is
``--name=value``.

xeonsd_method: what a method leaves in the run directory (its result file, what people call it, whether it is a
whole pipeline, its `xeonsd generate` flag); xeonsd_result_export: how a run's result reaches its images (the
export it gets and the generate arguments that load the result onto it).

The methods and their files are defined once, in the package's ``train/src/xeonsd/contracts/method_names.py``, and
what GenAI applies per family in ``train/src/xeonsd/modelfiles/family_specs.py`` (both standard library only),
which this plugin loads from the repository on the controller.
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
from xeonsd.modelfiles import family_specs  # noqa: E402

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


def result_export(summary: Mapping[str, Any], run_dir: str, lora_scale: Any = 1.0) -> dict[str, Any]:
    """How a finished run (train_summary.json names its method, result file, base model and family) reaches its
    images: ``{"own", "source", "args", "generate_args", "why"}``.

    * a whole pipeline (full) is exported itself: ``own``, ``source`` the run;
    * a LoRA of a family whose adapters GenAI does not apply (``FamilySpec.genai_adapters``: SD3, Z-Image) is fused
      into an export of its own: ``own``, ``source`` the base model, ``args`` ``--lora FILE --lora-scale S``;
    * otherwise the result loads onto the base model's shared export at generation time: ``generate_args``
      ``--embeds FILE`` or ``--lora FILE:SCALE``.
    """
    info = method(summary["method"])
    try:
        found = family_specs.run_spec(summary, run_dir)
    except family_specs.FamilyError as e:
        raise TrainArgvError(str(e)) from None
    path = f"{run_dir}/{summary['result']['path']}"
    if info["pipeline"]:
        return {"own": True, "source": run_dir, "args": [], "generate_args": [], "why": "its own pipeline"}
    if info["generate_flag"] == "--lora" and not found.genai_adapters:
        return {
            "own": True,
            "source": str(summary["base_model"]),
            "args": ["--lora", path, "--lora-scale", str(lora_scale)],
            "generate_args": [],
            "why": f"the LoRA fused into the base model: GenAI applies no adapters to {found.label}",
        }
    flag = info["generate_flag"]
    arg = f"{path}:{lora_scale}" if flag == "--lora" else path
    return {"own": False, "source": str(summary["base_model"]), "args": [], "generate_args": [flag, arg], "why": ""}


class FilterModule:
    def filters(self) -> dict:
        return {
            "xeonsd_train_argv": train_argv,
            "xeonsd_method": method,
            "xeonsd_result_export": result_export,
        }
