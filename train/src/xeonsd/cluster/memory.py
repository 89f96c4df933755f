"""Memory counted the way the kernel shares it: each rank's PSS, shared and private bytes, and a node's total.

RSS counts every page a process maps, so pages that several processes share (one file mapped read-only by every
rank, the libraries) are counted once per process, and the RSS of a node's ranks added up overstates what the node
holds. PSS (proportional set size) charges each page to the processes that map it in equal parts: a page shared
by 4 ranks counts a quarter in each, so the sum of the PSS of a node's ranks is what the node holds for them.
``shared`` is the resident bytes of pages some other process maps too (Shared_Clean + Shared_Dirty), ``private``
those only this process maps (Private_Clean + Private_Dirty); RSS = shared + private.

The figures come from ``/proc/<pid>/smaps_rollup`` (Linux 4.14 and later); elsewhere :func:`read_memory` raises
:class:`MemoryUnavailable` and the trainer runs on without the figures (:class:`RankMemory` logs that once). Every
``--stats_every`` steps and once the models are loaded, the ranks all-gather their figures and rank 0 adds them
up by node (:func:`node_totals`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("xeonsd.train")
PROC = Path("/proc")
# smaps_rollup's fields that make up the figures (kB in the file).
_FIELDS = {
    "Rss": "rss",
    "Pss": "pss",
    "Shared_Clean": "shared",
    "Shared_Dirty": "shared",
    "Private_Clean": "private",
    "Private_Dirty": "private",
}
FIGURES = ("rss_bytes", "pss_bytes", "shared_bytes", "private_bytes")


class MemoryUnavailable(OSError):
    """No ``/proc/<pid>/smaps_rollup`` to read: not Linux, a kernel older than 4.14, or the process is gone."""


@dataclass(frozen=True)
class ProcessMemory:
    """One process's memory in bytes, as the kernel counts it (see the module's docstring)."""

    rss_bytes: int
    pss_bytes: int
    shared_bytes: int
    private_bytes: int

    def as_floats(self) -> list[float]:
        return [float(getattr(self, f)) for f in FIGURES]

    @classmethod
    def from_floats(cls, values: list[float]) -> ProcessMemory:
        return cls(*(int(v) for v in values))


def parse_smaps_rollup(text: str, where: str = "smaps_rollup") -> ProcessMemory:
    """The figures of one ``smaps_rollup`` text; ValueError naming the field when one is missing or not a number."""
    sums = {"rss": 0, "pss": 0, "shared": 0, "private": 0}
    seen = set()
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name not in _FIELDS:
            continue
        parts = rest.split()
        if len(parts) != 2 or parts[1] != "kB" or not parts[0].isdigit():
            raise ValueError(f"{where}: cannot read {name!r} from {line!r} (expected '<number> kB')")
        sums[_FIELDS[name]] += int(parts[0]) * 1024
        seen.add(name)
    missing = [n for n in _FIELDS if n not in seen]
    if missing:
        raise ValueError(f"{where}: no {', '.join(missing)} line(s)")
    return ProcessMemory(sums["rss"], sums["pss"], sums["shared"], sums["private"])


def resident_bytes(pid: int | str = "self") -> int | None:
    """``pid``'s resident memory now (``VmRSS`` in ``/proc/<pid>/status``: cheap, no walk of the mappings, so it can
    be read every few milliseconds); None when the process is gone or the file has no such line (not Linux)."""
    try:
        text = (PROC / str(pid) / "status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


def read_memory(pid: int | str = "self") -> ProcessMemory:
    """``pid``'s figures now (``self``: this process). MemoryUnavailable when the file cannot be read."""
    path = PROC / str(pid) / "smaps_rollup"
    try:
        text = path.read_text()
    except OSError as exc:
        raise MemoryUnavailable(
            f"cannot read {path} ({exc.strerror or exc}): the PSS figures need Linux 4.14 or later"
        ) from exc
    return parse_smaps_rollup(text, str(path))


def total(figures: list[ProcessMemory]) -> ProcessMemory:
    """The figures added up: the PSS sum is what a node holds for these processes, the RSS sum counts every shared
    page once per process that maps it."""
    return ProcessMemory(*(sum(getattr(m, f) for m in figures) for f in FIGURES))


def node_totals(figures: list[ProcessMemory | None], nodes: list[str]) -> list[dict]:
    """Rank 0's per-node rows: ``figures[r]`` and ``nodes[r]`` are rank r's (None: the rank had no figures). Each
    row: the node, its ranks, the sums of the ranks' figures (bytes) and how many ranks had figures."""
    by_node: dict[str, list[int]] = {}
    for r, node in enumerate(nodes):
        by_node.setdefault(node, []).append(r)
    rows = []
    for node, ranks in by_node.items():
        known = [m for r in ranks if (m := figures[r]) is not None]
        if not known:
            continue
        rows.append({"node": node, "ranks": ranks, "measured_ranks": len(known), **vars(total(known))})
    return rows


class RankMemory:
    """This rank's figures, read when asked; once the file cannot be read it logs that once and answers None."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.unavailable = False
        self.peak_pss = 0  # rank 0: the highest node total it logged

    def read(self) -> ProcessMemory | None:
        if self.unavailable:
            return None
        try:
            return read_memory()
        except (MemoryUnavailable, ValueError) as exc:
            self.unavailable = True
            if self.rank == 0:
                log.warning("no memory figures for this job: %s", exc)
            return None

    def measure(self, world: int, nodes: list[str], when: str, record: Callable[[int, int, int], None]) -> list[dict]:
        """Every rank takes part: one all-gather of each rank's figures (-1: none). Its PSS, shared and private bytes
        go to ``record`` (its status file); rank 0 logs its node's total when it is the highest so far (``when``:
        'after loading', 'at step 40'). Returns the per-node totals (every rank gets them; rank 0 records them)."""
        from xeonsd.cluster.distributed import all_gather_floats

        mine = self.read()
        values = all_gather_floats(mine.as_floats() if mine else [-1.0] * len(FIGURES), world)
        rows = node_totals([ProcessMemory.from_floats(v) if v[0] >= 0 else None for v in values], nodes)
        if mine is not None:
            record(mine.pss_bytes, mine.shared_bytes, mine.private_bytes)
        own = [r for r in rows if r["node"] == nodes[0]]
        if self.rank == 0 and own and own[0]["pss_bytes"] > self.peak_pss:  # a new peak: the log stays short
            self.peak_pss = own[0]["pss_bytes"]
            log.info("memory %s: %s", when, describe(own))
        return rows


def describe(rows: list[dict]) -> str:
    """The node totals in one log line: 'node1 PSS 3.10 GB over 4 rank(s) (private 2.00 GB; RSS summed 4.30 GB)'.
    The RSS sum counts each shared page once per rank that maps it; the PSS sum counts it once."""
    return "; ".join(
        f"{r['node']} PSS {r['pss_bytes'] / 1e9:.2f} GB over {r['measured_ranks']} rank(s) (private "
        f"{r['private_bytes'] / 1e9:.2f} GB; RSS summed {r['rss_bytes'] / 1e9:.2f} GB)"
        for r in rows
    )
