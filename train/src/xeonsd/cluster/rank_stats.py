"""Each rank measures itself: CPU utilisation and the time split of its steps, gathered by rank 0 per interval.

Per step a rank adds up its wall time, its process CPU time (every thread of the process) and the seconds spent in
two phases: ``data`` (the sampling plan and the latent lookup) and ``allreduce`` (waiting in the gradient
all-reduce, which includes waiting for the slowest rank); ``compute`` is the rest (forward, backward, optimizer).
Its CPU utilisation is ``cpu_s / (wall_s × threads)``. Every ``stats_every`` steps the ranks exchange their sums in
one all-gather of a few floats, and rank 0 puts the per-rank and per-node summary into that step's metrics row.

A node is a straggler when its ranks stay under ``min_util`` CPU utilisation for ``intervals`` intervals in a row,
or when their compute time per step is more than ``ratio`` × the median node's. The verdict is rank 0's and goes
into the metrics row (``stragglers``), so the play and the report read it from there rather than judge again.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from xeonsd.contracts.straggler_rule import CAUSES, STRAGGLER_RATIO

# The ratio and the likely causes of a straggler are the straggler rule's (xeonsd.contracts.straggler_rule), doctor's too.
NODE_NAMES_ENV = "XEONSD_NODE_NAMES"  # "address=name,address=name": the inventory's names for the MPI addresses
FIELDS = ("steps", "wall_s", "cpu_s", "threads", "data_s", "allreduce_s")


@dataclass
class Interval:
    """One rank's sums over the steps of an interval."""

    steps: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    threads: int = 1
    data_s: float = 0.0
    allreduce_s: float = 0.0

    @property
    def compute_s(self) -> float:
        return max(0.0, self.wall_s - self.data_s - self.allreduce_s)

    @property
    def cpu_util(self) -> float:
        """Process CPU time over the wall time its threads could have used (can pass 1 with extra library threads)."""
        return self.cpu_s / (self.wall_s * max(1, self.threads)) if self.wall_s > 0 else 0.0

    def as_floats(self) -> list[float]:
        return [float(getattr(self, f)) for f in FIELDS]

    @classmethod
    def from_floats(cls, values: list[float]) -> Interval:
        d = dict(zip(FIELDS, values, strict=True))
        return cls(int(d["steps"]), d["wall_s"], d["cpu_s"], int(d["threads"]), d["data_s"], d["allreduce_s"])


class RankClock:
    """Measures this rank's steps: ``start_step``, ``phase("data"|"allreduce")`` blocks, ``end_step``; ``take``."""

    def __init__(self, threads: int, wall=time.perf_counter, cpu=time.process_time) -> None:
        self._wall, self._cpu = wall, cpu
        self.threads = threads
        self.current = Interval(threads=threads)
        self._t0 = self._c0 = 0.0

    def start_step(self) -> None:
        self._t0, self._c0 = self._wall(), self._cpu()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = self._wall()
        try:
            yield
        finally:
            setattr(self.current, f"{name}_s", getattr(self.current, f"{name}_s") + self._wall() - t)

    def end_step(self) -> None:
        self.current.steps += 1
        self.current.wall_s += self._wall() - self._t0
        self.current.cpu_s += self._cpu() - self._c0

    def take(self) -> Interval:
        done, self.current = self.current, Interval(threads=self.threads)
        return done


def node_names(env: dict[str, str] | None = None) -> dict[str, str]:
    """The address → inventory name map the finetune play passes in ``XEONSD_NODE_NAMES`` (empty when unset)."""
    text = (os.environ if env is None else env).get(NODE_NAMES_ENV, "")
    pairs = (item.split("=", 1) for item in text.split(",") if "=" in item)
    return {addr.strip(): name.strip() for addr, name in pairs}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summarize(intervals: list[Interval], nodes: list[str]) -> dict:
    """Rank 0's summary of one interval: ``intervals[r]`` and ``nodes[r]`` are rank r's; per step seconds."""
    ranks = []
    for r, (iv, node) in enumerate(zip(intervals, nodes, strict=True)):
        n = max(1, iv.steps)
        ranks.append(
            {
                "rank": r,
                "node": node,
                "threads": iv.threads,
                "cpu_util": round(iv.cpu_util, 4),
                "compute_s": round(iv.compute_s / n, 4),
                "allreduce_s": round(iv.allreduce_s / n, 4),
                "data_s": round(iv.data_s / n, 4),
            }
        )
    per_node: dict[str, list[dict]] = {}
    for row in ranks:
        per_node.setdefault(row["node"], []).append(row)
    node_rows = [
        {
            "node": node,
            "ranks": [r["rank"] for r in rows],
            **{k: round(_mean([r[k] for r in rows]), 4) for k in ("cpu_util", "compute_s", "allreduce_s", "data_s")},
        }
        for node, rows in per_node.items()
    ]
    median_compute = statistics.median(n["compute_s"] for n in node_rows)
    lowest = min(node_rows, key=lambda n: n["cpu_util"])
    slowest = max(node_rows, key=lambda n: n["compute_s"])
    return {
        "cpu_util": round(_mean([r["cpu_util"] for r in ranks]), 4),
        "lowest_node": lowest["node"],
        "lowest_cpu_util": lowest["cpu_util"],
        "slowest_node": slowest["node"],
        "slowest_compute_s": slowest["compute_s"],
        "median_compute_s": round(median_compute, 4),
        "nodes": node_rows,
        "ranks": ranks,
    }


@dataclass
class StragglerWatch:
    """Rank 0's straggler verdict over the intervals so far (see the module's docstring)."""

    min_util: float = 0.8
    ratio: float = STRAGGLER_RATIO
    intervals: int = 3
    low_streak: dict[str, int] = field(default_factory=dict)

    def judge(self, summary: dict) -> list[dict]:
        """The stragglers of this interval: node, ranks, why (the figures) and the likely causes in order."""
        found = []
        median = summary["median_compute_s"]
        for node in summary["nodes"]:
            name = node["node"]
            self.low_streak[name] = self.low_streak.get(name, 0) + 1 if node["cpu_util"] < self.min_util else 0
            why = []
            if self.low_streak[name] >= self.intervals:
                why.append(
                    f"CPU utilisation {node['cpu_util']:.0%} under {self.min_util:.0%} for "
                    f"{self.low_streak[name]} intervals"
                )
            if len(summary["nodes"]) > 1 and median > 0 and node["compute_s"] > self.ratio * median:
                why.append(
                    f"compute {node['compute_s']:.2f} s/step = {node['compute_s'] / median:.2f}× the median "
                    f"{median:.2f} s"
                )
            if why:
                found.append({"node": name, "ranks": node["ranks"], "why": why, "causes": list(CAUSES)})
        return found
