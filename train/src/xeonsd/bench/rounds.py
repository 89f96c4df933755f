"""Interleaved rounds and the statistics both benchmarks report on them (pure functions, but for ``probes``, which
measures the matmul peaks).

A shared machine drifts 2x within minutes (docs/benchmarks.md), so a benchmark that runs A, then B, then C
measures the drift as well as the variants. Both ``bench train`` and ``bench generate`` therefore run rounds of
A B C … (``schedule``), take each variant's median over the rounds with its spread (``spread``), and compare the
variants within each round: each round's B/A, then the median and spread of those ratios (``summarize``). The
matmul peak is probed before and after the variants; probes of one dtype that differ by more than
``TOLERANCE`` make the run say ``UNSTABLE`` on its last line (``stability``, ``verdict_lines``).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

TOLERANCE = 0.15
UNSTABLE = "machine unstable: read the ratios, not the seconds"


def schedule(names: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """(round, variant) in the order they run: A B C A B C … for ``rounds`` rounds."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    return [(r, name) for r in range(rounds) for name in names]


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and the quartiles (q1, q3: the IQR) of ``values``; n is how many."""
    if not values:
        raise ValueError("no values")
    vals = sorted(values)
    q1, q3 = (statistics.quantiles(vals, n=4, method="inclusive")[i] for i in (0, 2)) if len(vals) > 1 else vals * 2
    return {"median": statistics.median(vals), "min": vals[0], "max": vals[-1], "q1": q1, "q3": q3, "n": len(vals)}


def per_round_ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """``num[r] / den[r]`` for each round r: two variants compared only within the same round."""
    if len(num) != len(den):
        raise ValueError(f"{len(num)} rounds against {len(den)}")
    return [n / d for n, d in zip(num, den, strict=True)]


def summarize(times: Mapping[str, Sequence[float]], baseline: str, invert: bool = False) -> dict[str, dict]:
    """Per variant: its per-round seconds and their spread, and its per-round ratio to ``baseline`` (variant /
    baseline; ``invert``: baseline / variant, a speed-up) with the spread of those ratios."""
    base = times[baseline]
    out = {}
    for name, secs in times.items():
        ratios = per_round_ratios(base, secs) if invert else per_round_ratios(secs, base)
        out[name] = {"rounds": list(secs), "seconds": spread(secs), "ratio_rounds": ratios, "ratio": spread(ratios)}
    return out


def probes(repeats: int, seconds: float, max_n: int = 4096) -> list[dict]:
    """``repeats`` matmul peak probes of fp32 and bf16, alternating (:func:`xeonsd.flops.matmul_probes`: FLOP/s,
    several sizes each up to ``max_n``), as both benchmarks take them before and after their variants."""
    import torch

    from xeonsd.flops import matmul_probes

    return matmul_probes({"fp32": torch.float32, "bf16": torch.bfloat16}, repeats, max_n, seconds)


def stability(before: Sequence[Mapping], after: Sequence[Mapping], tolerance: float = TOLERANCE) -> dict:
    """Whether the machine held still: per dtype, the probes' peaks (``{"dtype", "peak"}``) before and after the
    variants, their median and spread, and how far apart the extreme probes are (max / min - 1). Over
    ``tolerance`` for any dtype: unstable."""
    by_dtype: dict[str, dict] = {}
    for dtype in dict.fromkeys(p["dtype"] for p in [*before, *after]):
        b = [p["peak"] for p in before if p["dtype"] == dtype]
        a = [p["peak"] for p in after if p["dtype"] == dtype]
        both = b + a
        by_dtype[dtype] = {
            "before": b,
            "after": a,
            "peak": spread(both),
            "difference": max(both) / min(both) - 1 if min(both) > 0 else float("inf"),
        }
    worst = max((d["difference"] for d in by_dtype.values()), default=0.0)
    return {"by_dtype": by_dtype, "difference": worst, "tolerance": tolerance, "unstable": worst > tolerance}


def verdict_lines(st: Mapping) -> list[str]:
    """The run's last lines: how far apart the probes are, then, when that is over the tolerance, ``UNSTABLE``
    alone on the last line."""
    diff = f"matmul peak probes before and after the variants differ by up to {st['difference']:.0%}"
    if st["unstable"]:
        return [f"{diff} (> {st['tolerance']:.0%})", UNSTABLE]
    return [f"{diff} (<= {st['tolerance']:.0%}): machine steady"]


def range_text(s: Mapping[str, float], fmt: str = ".2f") -> str:
    """``min-max`` of a ``spread``."""
    return f"{s['min']:{fmt}}-{s['max']:{fmt}}"
