"""Each rank measures itself: CPU utilisation and the time split of its steps, gathered by rank 0 per interval.

Per step a rank adds up its wall time, its process CPU time (every thread of the process) and the seconds spent in
two phases: ``data`` (the sampling plan and the latent lookup) and ``allreduce`` (waiting in the gradient
all-reduce, which includes waiting for the slowest rank); ``compute`` is the rest (forward, backward, optimizer).
Its CPU utilisation is ``cpu_s / (wall_s × threads)``. Every ``stats_every`` steps the ranks exchange their sums in
one all-gather of a few floats, and rank 0 puts the per-rank and per-node summary into that step's metrics row.

A node is a straggler when its ranks stay under ``min_util`` CPU utilisation for ``intervals`` intervals in a row
while other nodes do not, or when their compute time per step is more than ``ratio`` × the median node's. When
every node stays that low, no node is slower than the others: the cause is the job's layout (ranks per node ×
threads per rank against the node's physical cores) or a load the nodes share, and the verdict says so once, with
those figures (``layout_verdict``), instead of calling every node a straggler. Each rank reports its node's
physical cores; ``XEONSD_SHARED_CORES`` (the finetune role's ``cluster_shared_cores``) says that every node runs on
one machine's cores (the test cluster: network namespaces on one host). The verdict is rank 0's and goes into the
metrics row (``stragglers``, ``layout_verdict``), so the play and the report read it from there rather than judge
again.
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
# The physical cores that every node of the job shares (they are one machine's: the test cluster); unset or 0: each
# node has its own.
SHARED_CORES_ENV = "XEONSD_SHARED_CORES"
FIELDS = ("steps", "wall_s", "cpu_s", "threads", "data_s", "allreduce_s", "cores")


@dataclass
class Interval:
    """One rank's sums over the steps of an interval."""

    steps: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    threads: int = 1
    data_s: float = 0.0
    allreduce_s: float = 0.0
    cores: int = 0  # the physical cores of the rank's node (0: unknown)

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
        counts = ("steps", "threads", "cores")
        return cls(**{f: int(v) if f in counts else v for f, v in zip(FIELDS, values, strict=True)})


class RankClock:
    """Measures this rank's steps: ``start_step``, ``phase("data"|"allreduce")`` blocks, ``end_step``; ``take``."""

    def __init__(self, threads: int, wall=time.perf_counter, cpu=time.process_time, cores: int | None = None) -> None:
        self._wall, self._cpu = wall, cpu
        self.threads = threads
        self.cores = node_physical_cores() if cores is None else cores
        self.current = Interval(threads=threads, cores=self.cores)
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
        done, self.current = self.current, Interval(threads=self.threads, cores=self.cores)
        return done


def node_physical_cores() -> int:
    """The physical cores of this rank's node that the job may use: those its launcher's process may run on (the
    rank itself is pinned to its share by now), one per core (hyper-threads not counted); 0 when unknown."""
    from xeonsd.cluster.placement import physical_cores

    try:
        allowed = os.sched_getaffinity(os.getppid())
    except OSError:
        allowed = set(range(os.cpu_count() or 0))
    return len(physical_cores(set(allowed)))


def shared_cores(env: dict[str, str] | None = None) -> int:
    """``XEONSD_SHARED_CORES``: the physical cores that every node shares (0: each node has its own)."""
    text = (os.environ if env is None else env).get(SHARED_CORES_ENV, "").strip()
    return int(text) if text.isdigit() else 0


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
    cores = {r: iv.cores for r, iv in enumerate(intervals)}
    per_node: dict[str, list[dict]] = {}
    for row in ranks:
        per_node.setdefault(row["node"], []).append(row)
    node_rows = [
        {
            "node": node,
            "ranks": [r["rank"] for r in rows],
            **{k: round(_mean([r[k] for r in rows]), 4) for k in ("cpu_util", "compute_s", "allreduce_s", "data_s")},
            "threads": max(r["threads"] for r in rows),
            "cores": max(cores.get(r["rank"], 0) for r in rows),
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
    shared_cores: int = field(default_factory=shared_cores)

    def verdict(self, summary: dict) -> dict:
        """This interval's ``stragglers`` and, when every node is low on CPU, the ``layout_verdict`` (else no key)."""
        stragglers = self.judge(summary)
        layout = self.layout_verdict(summary)
        return {"stragglers": stragglers, **({"layout_verdict": layout} if layout else {})}

    def _everyone_low(self, summary: dict) -> bool:
        return all(self.low_streak.get(n["node"], 0) >= self.intervals for n in summary["nodes"])

    def judge(self, summary: dict) -> list[dict]:
        """The stragglers of this interval: node, ranks, why (the figures) and the likely causes in order. Low CPU
        use makes a node a straggler only while some other node is not low too (see ``layout_verdict``)."""
        found = []
        median = summary["median_compute_s"]
        for node in summary["nodes"]:
            name = node["node"]
            self.low_streak[name] = self.low_streak.get(name, 0) + 1 if node["cpu_util"] < self.min_util else 0
        everyone_low = self._everyone_low(summary)
        for node in summary["nodes"]:
            name = node["node"]
            why = []
            if self.low_streak[name] >= self.intervals and not everyone_low:
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

    def layout_verdict(self, summary: dict) -> dict | None:
        """When every node has been under ``min_util`` for ``intervals`` intervals (``judge`` counted them): the
        figures of the layout against the cores, and one sentence that names the cause; else None."""
        nodes = summary["nodes"]
        if not nodes or not self._everyone_low(summary):
            return None
        ranks = max(len(n["ranks"]) for n in nodes)
        threads = max(n.get("threads", 1) for n in nodes)
        cores = min(n.get("cores", 0) for n in nodes)
        figures = {
            "nodes": len(nodes),
            "cpu_util_low": min(n["cpu_util"] for n in nodes),
            "cpu_util_high": max(n["cpu_util"] for n in nodes),
            "ranks_per_node": ranks,
            "threads_per_rank": threads,
            "cores": cores,
            "shared_cores": self.shared_cores,
            "intervals": min(self.low_streak[n["node"]] for n in nodes),
        }
        return {**figures, "text": layout_text(figures, self.min_util)}


def layout_text(v: dict, min_util: float) -> str:
    """The layout verdict in one sentence, with its figures (what the play prints once and the report shows)."""
    per_node = v["ranks_per_node"] * v["threads_per_rank"]
    shape = f"{v['ranks_per_node']} ranks × {v['threads_per_rank']} thread{'s' if v['threads_per_rank'] > 1 else ''}"
    lo, hi = round(100 * v["cpu_util_low"]), round(100 * v["cpu_util_high"])
    low = f"{lo}-{hi}%" if hi != lo else f"{lo}%"
    nodes = f"all {v['nodes']} nodes" if v["nodes"] > 1 else "the node"
    head = (
        f"{nodes} equally low on CPU ({low}, under {min_util:.0%} for {v['intervals']} intervals), so no node is a "
        "straggler: the cause is the job's layout or the cluster's shared load. "
    )
    if v["shared_cores"]:
        total = v["nodes"] * per_node
        return head + (
            f"The {v['nodes']} nodes share one machine's {v['shared_cores']} physical cores (the test cluster): "
            f"{v['nodes']} nodes × {shape} = {total} threads on {v['shared_cores']} cores, at most "
            f"{min(1.0, v['shared_cores'] / total):.0%} of a core each. Expected there; on real nodes give each "
            "node its own cores."
        )
    if v["cores"] and per_node > v["cores"]:
        return head + (
            f"Each node runs {shape} = {per_node} threads on its {v['cores']} physical cores "
            f"({per_node / v['cores']:.1f}× oversubscribed). Fix: ranks per node × threads per rank = the node's "
            "physical cores (ansible-playbook doctor.yml -e tune_layout=true measures the best split)."
        )
    cores = f"its {v['cores']} physical cores" if v["cores"] else "its physical cores"
    return head + (
        f"Each node runs {shape} = {per_node} threads on {cores}, which fits: another load on every node (another "
        "job, or nodes that are virtual machines on one host) takes the cores, or the ranks wait outside the "
        "compute (the all-reduce, the data)."
    )
