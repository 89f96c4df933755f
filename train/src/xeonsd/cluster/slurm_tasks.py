"""Where an srun task sits in its job step, from Slurm's variables (standard library only).

``SLURM_STEP_TASKS_PER_NODE`` holds the step's task counts per node in Slurm's compressed form (``4(x3),2``);
``SLURM_NODEID`` is this task's node among them. :func:`xeonsd.cluster.launch.detect_ranks` reads a task's
local world size from them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_COUNT = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def expand_tasks_per_node(spec: str) -> list[int]:
    """Slurm's compressed task counts per node: ``4(x3),2`` = [4, 4, 4, 2]; ValueError for anything else."""
    counts: list[int] = []
    for part in spec.split(","):
        m = _COUNT.fullmatch(part.strip())
        if not m:
            raise ValueError(f"cannot read Slurm's tasks per node {spec!r} (expected e.g. 4(x3),2)")
        counts += [int(m[1])] * int(m[2] or 1)
    return counts


def tasks_on_node(env: Mapping[str, str]) -> int:
    """How many tasks of this job step run on this task's node; ValueError naming what is missing or wrong."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node = env.get("SLURM_NODEID", "")
    if not spec or not node.isdigit():
        raise ValueError(
            f"srun started this task without SLURM_STEP_TASKS_PER_NODE and a SLURM_NODEID (got {spec!r}, {node!r})"
        )
    counts = expand_tasks_per_node(spec)
    if int(node) >= len(counts):
        raise ValueError(f"SLURM_NODEID={node} is out of range for tasks per node {spec!r}")
    return counts[int(node)]
