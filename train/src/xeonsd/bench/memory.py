"""``xeonsd bench memory``: what a node holds for 1, 2, 4 … ranks of one training job, with the frozen weights
shared (``--share_weights on``) and with a private copy per rank (``off``), beside the trainer's per-node estimate.

Each run is a real ``mpirun -n R -ppn R xeonsd train`` on this machine. While it runs, the benchmark samples every
rank's PSS (``/proc/<pid>/smaps_rollup``, :mod:`xeonsd.cluster.memory`) every ``--sample-s`` and keeps the peak of
their sum, in the loading phase (until every rank's status file is past ``starting``) and in training; the time to the
first step comes from the run's ``train_summary.json``. The layouts run in interleaved rounds (R=1 off, R=1 on,
R=2 off, … then again): only figures of one round compare. The last lines are the issue's targets, each with the
figures it compares and whether it is met.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import fields
from pathlib import Path

from xeonsd.assets.models import arch_names
from xeonsd.bench import rounds as rnd
from xeonsd.cluster.memory import MemoryUnavailable, read_memory
from xeonsd.fsutil import atomic_file

GB = 1e9
# How each mode loads: "before" is how the trainer loaded before shared weights and phases (a private copy per rank,
# every model at once)
MODES = {
    "off": ["--share_weights=off"],
    "on": ["--share_weights=on"],
    "before": ["--share_weights=off", "--no-phased_loading"],
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xeonsd bench memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="pipeline directory (default: the --arch model, built once)")
    p.add_argument("--arch", choices=arch_names(), default="sd15", help="what to build when --model is not given")
    p.add_argument("--depth", type=int, default=None, help="flow archs only: their blocks cut to D")
    p.add_argument("--method", choices=("lora", "textual_inversion", "full"), default="lora")
    p.add_argument("--fsdp", action="store_true", help="full only: shard what trains over the ranks (--fsdp)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="ranks on the node, one layout each")
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--steps", type=int, default=2, help="training steps per run")
    p.add_argument("--images", type=int, default=2)
    p.add_argument("--batch", type=int, default=1, help="--train_batch_size of every rank")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds of every layout")
    p.add_argument(
        "--modes", nargs="+", choices=tuple(MODES), default=["off", "on"],
        help="loadings to compare for each rank count: shared weights off / on; before: off and every model at once",
    )  # fmt: skip
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto", help="auto: bf16 where native")
    p.add_argument("--sample-s", type=float, default=0.1, help="seconds between PSS samples")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p


def _descendants(pid: int) -> list[int]:
    """``pid``'s descendant processes (mpirun -> its proxy -> the ranks)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _is_rank(pid: int) -> bool:
    try:
        return b"xeonsd.cli" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


class PssSampler(threading.Thread):
    """The peak of the ranks' summed PSS while any of the ``ranks`` status files in ``status`` (a run's
    ``status/`` directory) is missing or says ``starting`` (loading), and once every one is past it (training)."""

    def __init__(self, pid: int, status: Path, every_s: float, ranks: int = 1) -> None:
        super().__init__(daemon=True)
        self.pid, self.status, self.every_s, self.ranks = pid, status, every_s, ranks
        self.peaks = {"loading": 0, "training": 0}
        self.series: list[tuple[float, str, list[int]]] = []  # (seconds, phase, each rank's PSS): --json has it
        self.done = threading.Event()

    def _phase(self) -> str:
        for r in range(self.ranks):
            try:
                if json.loads((self.status / f"rank-{r}.json").read_text()).get("state") == "starting":
                    return "loading"
            except (OSError, ValueError):
                return "loading"
        return "training"

    def run(self) -> None:
        start = time.monotonic()
        while not self.done.wait(self.every_s):
            ranks = []
            for pid in _descendants(self.pid):
                if _is_rank(pid):
                    with contextlib.suppress(MemoryUnavailable):  # a rank that just ended
                        ranks.append(read_memory(pid).pss_bytes)
            phase, total = self._phase(), sum(ranks)
            self.peaks[phase] = max(self.peaks[phase], total)
            self.series.append((round(time.monotonic() - start, 2), phase, ranks))


def run_layout(ranks: int, mode: str, base: list[str], out: Path, env: dict[str, str], every_s: float) -> dict:
    """One ``mpirun -n ranks`` run loading the ``mode`` way (:data:`MODES`): the node's PSS peaks per phase, the time to the
    first step, the shared files' bytes, and the trainer's per-node estimate for this layout."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise RuntimeError("mpirun is not on PATH (source the env's env.sh, or install impi-rt)")
    cmd = [mpirun, "-n", str(ranks), "-ppn", str(ranks), sys.executable, "-m", "xeonsd.cli", "train", *base]
    cmd += [*MODES[mode], f"--output_dir={out}", f"--shared_weights_dir={out.parent / 'shm'}"]
    with open(out.parent / f"{out.name}.log", "w") as logf:
        proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT)
        sampler = PssSampler(proc.pid, out / "status", every_s, ranks)
        sampler.start()
        code = proc.wait()
        sampler.done.set()
        sampler.join()
    log_text = (out.parent / f"{out.name}.log").read_text()
    refusal = next((ln for ln in log_text.splitlines() if "the estimated peak memory is" in ln), None)
    if code == 2 and refusal is not None:  # the trainer's own check: this layout does not fit this node
        shutil.rmtree(out, ignore_errors=True)
        return {"ranks": ranks, "share_weights": mode, "refused": refusal.split("error: ", 1)[-1]}
    if code != 0:
        raise RuntimeError(f"{ranks} rank(s), {' '.join(MODES[mode])}: exit {code}\n{log_text[-3000:]}")
    summary = json.loads((out / "train_summary.json").read_text())
    estimate = node_estimate(json.loads((out / "memory_estimate.json").read_text()), ranks, mode == "on")
    shutil.rmtree(out, ignore_errors=True)
    return {
        "ranks": ranks,
        "share_weights": mode,
        "loading_peak": sampler.peaks["loading"],
        "training_peak": sampler.peaks["training"],
        "first_step_s": summary["startup"]["time_to_first_step_s"],
        "shared_bytes": sum(summary["startup"].get("shared_weights_bytes", {}).values()),
        # what the ranks still mapped in training (T5 and the VAE are released before it)
        "shared_held_bytes": sum(summary["startup"].get("shared_weights_held_bytes", {}).values()),
        "series": sampler.series,
        "estimate": estimate,
    }


def node_estimate(saved: dict, ranks: int, shared: bool) -> dict[str, int]:
    """The trainer's per-node estimate (``memory_estimate.json``) for ``ranks`` ranks, by phase."""
    from xeonsd.trainer.memory.measure import MemoryEstimate

    est = MemoryEstimate(**{f.name: saved.get(f.name, 0) for f in fields(MemoryEstimate)})
    loading, training = est.per_node_phases(ranks, shared)
    return {"loading": loading, "training": training}


def format_rows(results: list[dict]) -> list[str]:
    lines = [
        f"{'round':>5} {'ranks':>5} {'loading':>7} {'loading peak':>13} {'(estimate)':>11} {'training peak':>14} {'(estimate)':>11} "
        f"{'shared files':>13} {'(in training)':>13} {'first step':>11}"
    ]
    for r in results:
        if "refused" in r:
            lines.append(
                f"{r.get('round', 0) + 1:>5} {r['ranks']:>5} {r['share_weights']:>7} refused by the trainer's estimate: {r['refused']}"
            )
            continue
        lines.append(
            f"{r.get('round', 0) + 1:>5} {r['ranks']:>5} {r['share_weights']:>7} {r['loading_peak'] / GB:>10.2f} GB {r['estimate']['loading'] / GB:>8.2f} GB "
            f"{r['training_peak'] / GB:>11.2f} GB {r['estimate']['training'] / GB:>8.2f} GB {r['shared_bytes'] / GB:>10.3f} GB "
            f"{r['shared_held_bytes'] / GB:>10.3f} GB {r['first_step_s']:>9.1f} s"
        )
    return lines


def _node_peak(result: dict) -> int:
    """A layout's node peak: the higher of its loading and training peaks."""
    return max(result["loading_peak"], result["training_peak"])


def targets(results: list[dict]) -> list[str]:
    """The targets, from one round's ``results``: the most ranks measured shared against the shared bytes + that many
    times one rank's private bytes (+10 %), and the loading peak of one shared rank against 1.1 x its training
    peak; and each shared layout against its private ones, ``off`` and ``before`` (ratios within the round)."""
    by = {(r["ranks"], r["share_weights"]): r for r in results if "refused" not in r}
    lines = []
    for n in sorted({r["ranks"] for r in results}):
        on = by.get((n, "on"))
        for base in ("off", "before"):
            off = by.get((n, base))
            if off and on:
                lines.append(
                    f"{n} rank(s): node peak shared / {'private' if base == 'off' else 'before'} = "
                    f"{_node_peak(on) / _node_peak(off):.2f}x ({_node_peak(on) / GB:.2f} / {_node_peak(off) / GB:.2f} GB); "
                    f"time to first step {on['first_step_s'] / off['first_step_s']:.2f}x"
                )
    shared_runs = [r for r in by.values() if r["share_weights"] == "on"]
    one, most = by.get((1, "on")), max(shared_runs, key=lambda r: r["ranks"], default=None)
    if one is not None and most is not None and most["ranks"] > 1:
        # in training, where the shared files still mapped are known (T5's and the VAE's are gone by then)
        shared = most["shared_held_bytes"]
        private = one["training_peak"] - one["shared_held_bytes"]
        bound = (shared + most["ranks"] * private) * 1.1
        top = most["training_peak"]
        met = "met" if top <= bound else "NOT met"
        lines.append(
            f"target: {most['ranks']} shared ranks' training peak <= shared + {most['ranks']} x one rank's private "
            f"+ 10 %: {top / GB:.2f} GB vs {bound / GB:.2f} GB ({shared / GB:.2f} + {most['ranks']} x "
            f"{private / GB:.2f}, +10 %): {met}"
        )
    if one is not None:
        ratio = one["loading_peak"] / max(1, one["training_peak"])
        met = "met" if ratio <= 1.1 else "NOT met"
        lines.append(f"target: loading peak <= 1.1 x training peak (1 rank, shared): {ratio:.2f}x: {met}")
    return lines


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if min(args.rounds, args.steps, args.batch, *args.ranks) < 1:
        print("xeonsd bench memory: error: --rounds, --steps, --batch and --ranks must be at least 1", file=sys.stderr)
        return 2
    if args.fsdp and args.method != "full":
        print("xeonsd bench memory: error: --fsdp shards a full fine-tune: add --method full", file=sys.stderr)
        return 2
    from xeonsd.assets import make_dataset
    from xeonsd.bench.train import resolve_model
    from xeonsd.bench.train_variants import method_args
    from xeonsd.cpu import cpu_info

    model = resolve_model(args)
    if model is None:
        return 2
    cpu = cpu_info()
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if cpu.native_bf16 else "fp32")
    env = dict(os.environ, HF_HUB_OFFLINE="1", I_MPI_FABRICS=os.environ.get("I_MPI_FABRICS", "shm"))
    layouts = [f"{n}:{mode}" for n in args.ranks for mode in dict.fromkeys(args.modes)]
    results = []
    with tempfile.TemporaryDirectory(prefix="xeonsd-bench-memory-") as tmp:
        data = Path(tmp) / "data"
        make_dataset(data, count=args.images, size=args.resolution)
        base = [
            f"--pretrained_model_name_or_path={model}",
            f"--train_data_dir={data}",
            *method_args(args.method),
            f"--resolution={args.resolution}",
            f"--train_batch_size={args.batch}",
            f"--max_train_steps={args.steps}",
            f"--mixed_precision={'bf16' if dtype == 'bf16' else 'no'}",
            "--checkpointing_steps=0",
            "--stats_every=1",
            *(["--fsdp"] if args.fsdp else []),
        ]
        for r, name in rnd.schedule(layouts, args.rounds):
            n, mode = name.split(":")
            env["MASTER_PORT"] = str(29900 + (os.getpid() + len(results)) % 90)
            row = run_layout(int(n), mode, base, Path(tmp) / f"r{r}-{n}-{mode}", env, args.sample_s)
            results.append({**row, "round": r})
            print(f"round {r + 1}: {n} rank(s), share {mode}: done", file=sys.stderr, flush=True)
    title = f"{args.method}{' --fsdp' if args.fsdp else ''} on {model}, {args.resolution} px, batch {args.batch}, {dtype}, {args.steps} step(s); CPU: {cpu.model}"
    lines = [title, *format_rows(results)]
    for k in range(args.rounds):  # the ratios of one round only: the machine drifts between rounds
        lines += [f"round {k + 1}:", *(f"  {line}" for line in targets([r for r in results if r["round"] == k]))]
    print("\n".join(lines), flush=True)
    if args.json:
        with atomic_file(args.json, "w") as fh:
            fh.write(json.dumps({"cpu": cpu.model, "dtype": dtype, "results": results, "lines": lines}, indent=2))
    return 0
