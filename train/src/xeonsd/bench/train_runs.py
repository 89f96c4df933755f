"""The runs ``xeonsd bench train`` measures: each variant is a real ``xeonsd train`` process in an output directory
of its own (its peak RSS is its own), in interleaved rounds; and one real 2-rank ``mpirun`` run for the bytes
all-reduced per step."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from xeonsd.bench import rounds as rnd
from xeonsd.bench.train_variants import Variant
from xeonsd.contracts.run_files import TRAIN_SUMMARY_FILE
from xeonsd.trainer.memory import ESTIMATE_FILE

log = logging.getLogger(__name__)


def measure_allreduce(base_args: list[str], out: Path, env: dict[str, str]) -> tuple[int | None, str]:
    """Bytes all-reduced per step on a real 2-rank mpirun run (its second step, recorded by the profiler); None
    and the reason when the run could not be made (no mpirun, or two ranks do not fit in this machine's memory)."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return None, "mpirun not found"
    args = [a for a in base_args if not a.startswith("--max_train_steps")] + ["--max_train_steps=2"]
    cmd = [mpirun, "-n", "2", sys.executable, "-m", "xeonsd.cli", "train", *args, f"--output_dir={out}"]
    env = dict(env, I_MPI_FABRICS=env.get("I_MPI_FABRICS", "shm"), MASTER_PORT=str(29800 + os.getpid() % 100))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        reason = next((ln for ln in reversed(proc.stderr.splitlines()) if "error" in ln), "failed")
        return None, reason.strip()[-300:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    measured = [r["allreduce_bytes_measured"] for r in rows if "allreduce_bytes_measured" in r]
    return (measured[0], "") if measured else (None, "no collective was recorded")


def run_variant(variant: Variant, base_args: list[str], out: Path, env: dict[str, str]) -> dict:
    """One run of ``variant`` in ``out``: its metrics rows, its own peak RSS (wait4) and the trainer's memory
    estimate; the output directory is removed after it."""
    train = [sys.executable, "-m", "xeonsd.cli", "train", *base_args, *variant.flags]
    cmd = [*(variant.command or train), f"--output_dir={out}"]
    log.info("running %s: %s", variant.name, " ".join(cmd[3:]))
    launched = time.time()
    with open(out.parent / f"{out.name}.log", "w") as logf:
        proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = (out.parent / f"{out.name}.log").read_text()[-3000:]
        raise RuntimeError(f"variant {variant.name!r} failed (exit {proc.returncode}):\n{tail}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    estimate_file = out / ESTIMATE_FILE
    estimate = json.loads(estimate_file.read_text()) if estimate_file.is_file() else {}
    summary_file = out / TRAIN_SUMMARY_FILE  # an unchanged diffusers script writes none
    trained = json.loads(summary_file.read_text()).get("trainable_params") if summary_file.is_file() else None
    shutil.rmtree(out, ignore_errors=True)  # a full fine-tune writes a whole UNet per run: rounds would fill the disk
    return {
        "rows": rows,
        "peak_rss_gb": usage.ru_maxrss * 1024 / 1e9,
        "estimate": estimate,
        "launched": launched,
        "trainable_params": trained,
    }


def run_rounds(variants: list[Variant], rounds: int, base_args: list[str], tmp: Path, env: dict[str, str]) -> dict:
    """Each variant once per round, in the order ``rnd.schedule`` gives (A B C A B C …): its runs, by name."""
    runs: dict[str, list[dict]] = {v.name: [] for v in variants}
    by_name = {v.name: (i, v) for i, v in enumerate(variants)}
    for r, name in rnd.schedule(list(runs), rounds):
        i, variant = by_name[name]
        runs[name].append(run_variant(variant, base_args, tmp / f"v{i}r{r}", env))
        log.info("round %d of %d: %s done", r + 1, rounds, name)
    return runs
