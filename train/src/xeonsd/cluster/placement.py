"""Where a rank runs: its own share of the node's physical cores, unless the user or the launcher already chose."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from xeonsd.cluster.launch import RankInfo


def physical_cores(allowed: set[int]) -> list[int]:
    """One logical CPU per physical core among ``allowed`` (the first hyper-thread of each core)."""
    seen: dict[tuple[int, int], int] = {}
    for cpu in sorted(allowed):
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = (int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text()))
        except (OSError, ValueError):
            key = (0, cpu)
        seen.setdefault(key, cpu)
    return sorted(seen.values())


@dataclass(frozen=True)
class Placement:
    threads: int
    cpus: tuple[int, ...]
    source: str  # "auto", "user", or "launcher"


def place_rank(info: RankInfo, env: Mapping[str, str] | None = None) -> Placement:
    """Give this rank its own share of the node's physical cores, unless the user or launcher already did.

    Respects ``OMP_NUM_THREADS`` when set, and an affinity mask narrower than the machine (Intel MPI pins
    ranks to domains by default). Otherwise the node's physical cores are split into ``local_world_size``
    contiguous blocks; with fewer cores than ranks, ranks share cores one thread each.
    """
    env = os.environ if env is None else env
    allowed = set(os.sched_getaffinity(0))
    online = os.cpu_count() or len(allowed)
    user_threads = env.get("OMP_NUM_THREADS")
    narrowed = len(allowed) < online
    cores = physical_cores(allowed)
    if narrowed or user_threads:
        threads = int(user_threads) if user_threads else max(1, len(cores))
        torch.set_num_threads(threads)
        return Placement(threads, tuple(sorted(allowed)), "user" if user_threads else "launcher")
    n = info.local_world_size
    if len(cores) >= n:
        per = len(cores) // n
        mine = cores[info.local_rank * per : (info.local_rank + 1) * per]
    else:
        mine = [cores[info.local_rank % len(cores)]]
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))
    torch.set_num_threads(len(mine))
    return Placement(len(mine), tuple(mine), "auto")
