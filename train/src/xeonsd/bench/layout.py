"""``xeonsd bench layout -- TRAIN_ARGS``: ranks per node × threads per rank, measured on this node.

Each layout (:func:`xeonsd.contracts.layout_result.layouts`: every split of the node's physical cores) trains a few steps
with the job's own arguments under ``mpirun -n R -ppn R`` on this node alone, pinned as the job pins its ranks
(Intel MPI's default pinning; the trainer's placement, :func:`xeonsd.cluster.placement.place_rank`, gives each
rank the cores of its domain). The layouts run in rounds (A B A B …: a shared machine drifts, so only layouts
compared within a round give ratios that hold); each trial's figure is the median images/s per node over its steps
after the warm-up. A layout whose ranks do not fit in the node's memory (the trainer's estimate, as ``xeonsd
doctor`` checks it) is skipped. Prints a line per layout and the best; ``--json`` prints the result
(:mod:`xeonsd.contracts.layout_result`'s schema) as the last line, ``--out`` writes it (temporary name, then renamed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from xeonsd.bench import rounds as rounds_mod
from xeonsd.contracts import layout_result
from xeonsd.fsutil import atomic_file

# Launcher variables of an outer job: each trial is a job of its own on this node.
_LAUNCHER_VARS = ("PMI_", "MPI_LOCAL", "OMPI_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "HYDRA_")
# A trial trains a few steps into a scratch directory: it drops the job's run flags (layout_result.RUN_FLAGS).


def physical_cores() -> int:
    from xeonsd.cluster import placement

    return len(placement.physical_cores(set(os.sched_getaffinity(0))))


def _local_address(addr: str | None) -> str:
    """``addr`` when this node can listen on it (the job's MASTER_ADDR on the primary), else 127.0.0.1."""
    if addr:
        try:
            with socket.socket() as s:
                s.bind((addr, 0))
            return addr
        except OSError:
            pass
    return "127.0.0.1"


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def trial_env(env: dict[str, str]) -> dict[str, str]:
    """The job's environment for one trial on this node: no outer launcher, a rendezvous of its own on this node
    (on a free port, so a running job is not disturbed), and no fixed thread count (the layout sets it)."""
    out = {k: v for k, v in env.items() if not k.startswith(_LAUNCHER_VARS)}
    out.pop("OMP_NUM_THREADS", None)
    addr = _local_address(env.get("MASTER_ADDR"))
    out.update(MASTER_ADDR=addr, MASTER_PORT=str(_free_port(addr)))
    return out


def trial_command(mpirun: str, ranks: int, train_args: list[str], steps: int, out: Path) -> list[str]:
    cmd = [mpirun, "-n", str(ranks), "-ppn", str(ranks), sys.executable, "-m", "xeonsd.cli", "train"]
    cmd += [*layout_result.job_args(train_args), f"--max_train_steps={steps}", "--checkpointing_steps=0"]
    return [*cmd, "--log_every=1", f"--output_dir={out}", "--overwrite_output_dir"]


def images_per_s(metrics: list[dict], warmup: int) -> float:
    """The median images/s per node of the steps after ``warmup`` (all of them when there are no more)."""
    rows = [r for r in metrics if r["step"] > warmup] or metrics
    if not rows:
        raise layout_result.LayoutError("the trial wrote no metrics")
    return statistics.median(float(r["images_per_s"]) for r in rows)


def run_trial(mpirun: str, layout: tuple[int, int], train_args: list[str], args, tmp: Path) -> float:
    ranks, threads = layout
    out = tmp / f"{ranks}x{threads}"
    cmd = trial_command(mpirun, ranks, train_args, args.warmup + args.steps, out)
    try:
        proc = subprocess.run(
            cmd, env=trial_env(dict(os.environ)), capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        raise layout_result.LayoutError(
            f"{ranks} x {threads}: the trial did not finish within {args.timeout:.0f} s"
        ) from None
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        cause = next((ln for ln in reversed(lines) if "error" in ln.lower()), lines[-1] if lines else "no output")
        raise layout_result.LayoutError(f"{ranks} x {threads}: the trial failed (rc {proc.returncode}): {cause}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    shutil.rmtree(out, ignore_errors=True)
    return images_per_s(rows, args.warmup)


def fitting(candidates: list[tuple[int, int]], train_args: list[str]) -> tuple[list[tuple[int, int]], dict]:
    """The layouts whose ranks fit in this node's memory, and why each other one is skipped. Arguments that the
    trainer refuses fail here, with doctor's detail."""
    from xeonsd.ops.doctor import check_inputs

    ok, skipped = [], {}
    for layout in candidates:
        checks = check_inputs(train_args, layout[0])
        bad = [c for c in checks if c.status == "FAIL" and c.name != "memory"]
        if bad:
            raise layout_result.LayoutError(f"{bad[0].name}: {bad[0].detail}")
        memory = [c for c in checks if c.name == "memory" and c.status == "FAIL"]
        if memory:
            skipped[layout] = memory[0].detail
        else:
            ok.append(layout)
    return ok, skipped


def measure(args: argparse.Namespace, train_args: list[str], log=print) -> dict:
    cores = physical_cores()
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise layout_result.LayoutError("mpirun is not on the PATH (run under /etc/xeonsd/run, or provision the node)")
    candidates, skipped = fitting(layout_result.layouts(cores, args.ranks), train_args)
    names = [f"{r}x{t}" for r, t in candidates]
    by_name = dict(zip(names, candidates, strict=True))
    figures: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="xeonsd-layout-") as tmp:
        for rnd, name in rounds_mod.schedule(names, args.rounds) if names else []:
            figures[name].append(run_trial(mpirun, by_name[name], train_args, args, Path(tmp)))
            log(
                f"round {rnd + 1}/{args.rounds}: {name.replace('x', ' ranks x ')} threads: {figures[name][-1]:.3f} images/s"
            )
    return build_result(cores, figures, by_name, skipped, train_args, args)


def build_result(cores, figures, by_name, skipped, train_args, args) -> dict:
    entries = []
    first = next(iter(figures), None)
    for name, values in figures.items():
        ratios = rounds_mod.per_round_ratios(values, figures[first])
        r, t = by_name[name]
        entries.append(
            {
                "ranks_per_node": r,
                "threads_per_rank": t,
                "status": "measured",
                "images_per_s": values,
                "median_images_per_s": statistics.median(values),
                "ratio_to_first": statistics.median(ratios),
                "detail": "",
            }
        )
    for (r, t), why in skipped.items():
        entries.append({"ranks_per_node": r, "threads_per_rank": t, "status": "skipped", "detail": why})
    entries.sort(key=lambda m: m["ranks_per_node"])
    best = layout_result.best_layout(entries)
    return {
        "schema": layout_result.SCHEMA,
        "node": os.uname().nodename,
        "cores": cores,
        "measured": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "rounds": args.rounds,
        "steps": args.steps,
        "train_args": list(train_args),
        "layouts": entries,
        "best": {
            "ranks_per_node": best["ranks_per_node"],
            "threads_per_rank": best["threads_per_rank"],
            "images_per_s": best["median_images_per_s"],
        },
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="xeonsd bench layout",
        description=__doc__.splitlines()[0],
        usage="xeonsd bench layout [--rounds N] [--steps N] [--warmup N] [--ranks R,…] [--json] [--out FILE] "
        "-- TRAIN_ARGS…",
    )
    p.add_argument("--rounds", type=int, default=2, help="rounds of every layout, interleaved (default 2)")
    p.add_argument("--steps", type=int, default=2, help="measured steps per trial (default 2)")
    p.add_argument("--warmup", type=int, default=1, help="steps per trial before the measured ones (default 1)")
    p.add_argument(
        "--ranks",
        type=lambda s: [int(x) for x in s.split(",") if x.strip()],
        default=[],
        help="only these ranks per node, comma-separated (default: every split of the physical cores)",
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds one trial may take (default 1800)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line at the end")
    p.add_argument("--out", type=Path, help="write the result (JSON) to this file")
    return p


def main(argv: list[str]) -> int:
    parser = build_parser()
    if "--" not in argv:
        parser.error(
            "give the training arguments after --, e.g. xeonsd bench layout -- --pretrained_model_name_or_path …"
        )
    split = argv.index("--")
    args = parser.parse_args(argv[:split])
    for flag in ("rounds", "steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must not be negative")
    progress = sys.stderr if args.json else sys.stdout
    try:
        result = measure(args, argv[split + 1 :], log=lambda line: print(line, file=progress, flush=True))
    except layout_result.LayoutError as exc:
        print(f"xeonsd bench layout: error: {exc}", file=sys.stderr)
        return 2
    for line in layout_result.result_lines(result):
        print(line, file=progress)
    if args.out:
        with atomic_file(args.out, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
    return 0
