"""What ``xeonsd bench train`` prints and writes: one variant's figures over its interleaved rounds, its profiled step
per class of work, and the table."""

from __future__ import annotations

import math
import statistics

from xeonsd import step_profile as sp
from xeonsd.bench import rounds as rnd


def step_seconds(rows: list[dict], warmup: int) -> float:
    """One run's median s/step over its timed steps."""
    return statistics.median(r["s_per_step"] for r in rows[warmup:])


def startup_seconds(run: dict) -> float:
    """Seconds from the process's launch to its first step's start (the first row's end less its own seconds: the
    runner of diffusers' scripts times that row from the script's first module call). NaN for a run recorded
    without its launch time."""
    first = run["rows"][0]
    if "launched" not in run or "time" not in first:
        return float("nan")
    return first["time"] - first["s_per_step"] - run["launched"]


def summarize(name: str, runs: list[dict], warmup: int, peak_tflops: float, stats: dict) -> dict:
    """One variant over its rounds: ``stats`` is its entry of ``rnd.summarize`` (seconds and ratio per round)."""
    rows = runs[0]["rows"]
    s_step = stats["seconds"]["median"]
    tflop = next((r["tflop_per_rank"] for r in rows if "tflop_per_rank" in r), float("nan"))
    return {
        "variant": name,
        "s_per_step": s_step,
        "steps_timed": len(rows[warmup:]),
        "tflop_per_step": tflop,
        "tflops": tflop / s_step,
        "of_peak": tflop / s_step / peak_tflops,
        "peak_rss_gb": max(run["peak_rss_gb"] for run in runs),
        # The trainer's own estimate (memory_estimate.json), NaN where the run wrote none.
        "estimate_training_gb": runs[0].get("estimate", {}).get("training", float("nan")) / 1e9,
        "estimate_loading_gb": runs[0].get("estimate", {}).get("loading", float("nan")) / 1e9,
        "allreduce_bytes": rows[-1].get("allreduce_bytes"),  # None: a script that does not say (diffusers')
        "trainable_params": runs[0].get("trainable_params"),  # train_summary.json's; None: diffusers' script
        "startup_s": statistics.median(startup_seconds(run) for run in runs),
        "rounds": len(runs),
        "s_per_step_rounds": stats["rounds"],
        "s_per_step_spread": stats["seconds"],
        "x_optimized": stats["ratio"]["median"],
        "x_optimized_rounds": stats["ratio_rounds"],
        "x_optimized_spread": stats["ratio"],
    }


def profile_summary(runs: list[dict], peak_tflops: float) -> dict:
    """One variant's profiled step over its rounds: each class's median seconds and the median wall time, its FLOPs
    (the first step's count, the same every round), and the rows of ``xeonsd.step_profile.class_rows``."""
    profiles = [next(r["step_profile"] for r in run["rows"] if "step_profile" in r) for run in runs]
    tflop = next(r["tflop_by_class"] for r in runs[0]["rows"] if "tflop_by_class" in r)
    seconds = {c: statistics.median(p["seconds_by_class"][c] for p in profiles) for c in sp.CLASSES}
    wall = statistics.median(p["wall_s"] for p in profiles)
    return {"wall_s": wall, "rounds": len(profiles), "classes": sp.class_rows(seconds, tflop, peak_tflops)}


def format_table(results: list[dict], peaks: dict[str, float], dtype: str, cpu: str, method: str = "") -> str:
    rounds = results[0].get("rounds", 1)
    lines = [
        f"CPU: {cpu}; method: {method}; training dtype: {dtype}",
        "matmul peak measured in this run: " + ", ".join(f"{k} {v:.3f} TFLOP/s" for k, v in peaks.items()),
        f"{rounds} interleaved round(s) of the variants; s/step: median of the rounds (min-max); x optimized: median "
        "of each round's ratio to that round's optimized run (min-max); peak RSS measured, est. train / est. load: "
        "the trainer's own estimate of its training and loading peak (GB)",
        f"{'variant':<24}{'s/step':>9}{'min-max':>16}{'x optimized':>13}{'min-max':>13}{'TFLOP/step':>12}"
        f"{'TFLOP/s':>9}{'of peak':>9}{'peak RSS GB':>13}{'est. train':>12}{'est. load':>11}{'start-up s':>12}"
        f"{'all-reduce B/step':>19}{'trained params':>16}",
    ]
    for r in results:
        lines.append(
            f"{r['variant']:<24}{r['s_per_step']:>9.2f}{rnd.range_text(r['s_per_step_spread']):>16}"
            f"{r['x_optimized']:>13.2f}{rnd.range_text(r['x_optimized_spread']):>13}{_num(r['tflop_per_step'], '.3f', 12)}"
            f"{_num(r['tflops'], '.3f', 9)}{_num(r['of_peak'], '.1%', 9)}{r['peak_rss_gb']:>13.2f}"
            f"{_num(r.get('estimate_training_gb'), '.2f', 12)}{_num(r.get('estimate_loading_gb'), '.2f', 11)}"
            f"{_num(r.get('startup_s'), '.1f', 12)}{_num(r['allreduce_bytes'], ',', 19)}"
            f"{_num(r.get('trainable_params'), ',', 16)}"
        )
    return "\n".join(lines)


def _num(value: float | None, fmt: str, width: int) -> str:
    """``value`` right-aligned in ``width``, or "-" where it was not measured (None or NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{'-':>{width}}"
    return f"{value:>{width}{fmt}}"
