"""diffusers' own example training scripts as a ``bench train`` variant, for the target of twice their speed (bench/targets.py).

Which script matches a method and family, its flags for the same model, images, resolution, precision, seed and
step count as the ``xeonsd train`` runs beside it, and the runner that times its steps:
``python -m xeonsd.bench.diffusers_examples SCRIPT ARGS...`` runs the script unchanged in its own process, records
the wall clock after every optimizer step (torch's global optimizer step hook) and at the first call of any module
(a global forward pre-hook, removed at once: the scripts load their models without calling them, so that is
their first step's start), and when the script ends writes those steps to ``<--output_dir>/metrics.jsonl`` in the
shape ``xeonsd train`` writes them (``step``, ``s_per_step``, ``time``; the first row's ``s_per_step`` from the
first module call), so the bench reads both alike. A script that fails after its last optimizer step (the SDXL
LoRA script's final ``load_lora_weights`` refuses offline mode) still has every step timed: the runner says what
failed and writes the rows; one that fails before writes nothing and exits with the script's status. Everything
the script does per step (its VAE encode, its text encoder, its data loader) is inside its steps, as it is for a
user who runs it.

The scripts come from a diffusers source checkout at the pinned tag (``diffusers_git_ref``); they import
torchvision, and the LoRA and full ones ``datasets`` (and peft), which our stack does not install.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING

from xeonsd.fsutil import atomic_file

if TYPE_CHECKING:
    from xeonsd.families import FamilySpec

VARIANT = "diffusers example"

# What each method's script imports beyond our stack (its examples/*/requirements.txt).
NEEDS = {
    "textual_inversion": ("torchvision.transforms",),
    "lora": ("torchvision.transforms", "datasets", "peft"),
    "full": ("torchvision.transforms", "datasets"),
}

# The scripts that read a captioned image folder (datasets' imagefolder + metadata.jsonl); textual inversion's
# script reads every file of its folder as an image and builds its own prompts.
CAPTIONED = ("lora", "full")


class ExamplesError(ValueError):
    """The examples folder or this venv cannot run the reference script; the message says what to fix."""


def script_for(examples: Path, method: str, family: FamilySpec) -> Path:
    """The example script for ``method`` on ``family`` (its spec's ``example_scripts``) in ``examples`` (a
    diffusers checkout's examples/ folder)."""
    rel = dict(family.example_scripts).get(method)
    if rel is None:
        from xeonsd.families import REGISTRY

        have = ", ".join(f"{m} on {f.label}" for f in REGISTRY for m, _ in f.example_scripts)
        raise ExamplesError(
            f"no diffusers example script is compared for --method {method} on {family.label} (compared: {have})"
        )
    script = Path(examples) / rel
    if not script.is_file():
        raise ExamplesError(
            f"--diffusers-examples {examples}: {rel} not found there. Fix: give the examples/ folder of a diffusers "
            "source checkout at the pinned tag (git clone --branch <diffusers_git_ref> "
            "https://github.com/huggingface/diffusers; the tag is in inventory/group_vars/all/versions.yml)"
        )
    return script


def check_imports(method: str, python: str = sys.executable) -> None:
    """Import what ``method``'s script needs in a fresh interpreter of this venv; raise with the fix if one fails
    (PyPI's torchvision is a CUDA build that does not load beside the CPU torch)."""
    modules = NEEDS[method]
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    proc = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["failed"])[-1]
        raise ExamplesError(
            f"diffusers' {method} example needs {', '.join(m.split('.')[0] for m in modules)} importable in this "
            f"venv, and the import failed: {last}. Fix: pip install torchvision --index-url "
            "https://download.pytorch.org/whl/cpu (the CPU build matching torch), and 'datasets<5' and peft for the "
            "LoRA and full scripts"
        )


def script_args(
    method: str, *, model: str, data: Path, resolution: int, steps: int, dtype: str, seed: int
) -> list[str]:
    """The script's flags for the job ``xeonsd train`` runs beside it (its defaults for everything else)."""
    args = [
        f"--pretrained_model_name_or_path={model}",
        f"--train_data_dir={data}",
        f"--resolution={resolution}",
        "--train_batch_size=1",
        f"--max_train_steps={steps}",
        f"--mixed_precision={'bf16' if dtype == 'bf16' else 'no'}",
        f"--seed={seed}",
        "--dataloader_num_workers=0",
        # accelerate has no "none"; "all" keeps the trackers that are installed (none in our stack).
        "--report_to=all",
    ]
    if method == "textual_inversion":
        args += ["--placeholder_token=<dicoo>", "--initializer_token=toy"]
    elif method == "lora":
        args += ["--rank=4"]
    return args


def reference_command(
    script: Path, tmp: Path, *, method: str, model: str, images: int, resolution: int, steps: int, dtype: str, seed: int
) -> tuple[str, ...]:
    """The runner's command for ``script`` (``--output_dir`` is added by the caller). The scripts that read captions
    get their own folder of the same images (``make_dataset``'s seed) with a metadata.jsonl; the others read
    ``tmp/data``, the folder ``xeonsd train`` reads."""
    data = tmp / "data"
    if method in CAPTIONED:
        from xeonsd.assets import make_dataset

        data = tmp / "data-captioned"
        make_dataset(data, count=images, size=resolution, captions="metadata")
    flags = script_args(method, model=model, data=data, resolution=resolution, steps=steps, dtype=dtype, seed=seed)
    return (sys.executable, "-m", "xeonsd.bench.diffusers_examples", str(script), *flags)


def step_rows(start: float, ends: list[float]) -> list[dict]:
    """One row per optimizer step: its number, seconds since the previous step ended (the first: since ``start``,
    the first step's start) and the wall clock at its end."""
    return [{"step": i, "s_per_step": t - prev, "time": t} for i, (prev, t) in enumerate(pairwise([start, *ends]), 1)]


def _flag(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a.startswith(f"{name}="):
            return a.split("=", 1)[1]
        if a == name and i + 1 < len(args):
            return args[i + 1]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not Path(argv[0]).is_file():
        print("usage: python -m xeonsd.bench.diffusers_examples SCRIPT [ARGS...] (SCRIPT must exist)", file=sys.stderr)
        return 2
    script, args = Path(argv[0]).resolve(), argv[1:]
    if (out := _flag(args, "--output_dir")) is None:
        raise SystemExit("xeonsd.bench.diffusers_examples: error: the script's --output_dir is where the steps go")
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook

    starts: list[float] = []
    ends: list[float] = []

    def first_call(*_) -> None:
        starts.append(time.time())
        first.remove()

    first = register_module_forward_pre_hook(first_call)
    handle = register_optimizer_step_post_hook(lambda *_: ends.append(time.time()))
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.parent))
    steps = _flag(args, "--max_train_steps")
    try:
        runpy.run_path(str(script), run_name="__main__")
    except (Exception, SystemExit) as exc:
        if isinstance(exc, SystemExit) and exc.code in (None, 0):
            pass
        elif steps is None or len(ends) < int(steps):
            raise
        else:
            print(
                f"xeonsd.bench.diffusers_examples: {script.name} failed after its last optimizer step ({steps} "
                f"steps timed): {type(exc).__name__}: {exc}",
                file=sys.stderr,
            )
    finally:
        handle.remove()
        first.remove()
    os.makedirs(out, exist_ok=True)
    with atomic_file(Path(out) / "metrics.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in step_rows(starts[0] if starts else time.time(), ends))
    return 0


if __name__ == "__main__":
    sys.exit(main())
