"""xeonsd_ranks_mismatch: the one rule of the job's shape, mpi_ranks == nodes x ranks_per_node.

mpirun starts ``-n mpi_ranks`` ranks, ``-ppn ranks_per_node`` on each node of the nodefile; any other total leaves
nodes idle or piles ranks onto the first ones. Preflight refuses such an inventory, the finetune role checks it
again for -e overrides, and doctor's nodefile row reports it: all three with this filter and its message.
``auto`` in either (ranks_per_node: the tuned layout, plugins/filter/xeonsd_layout.py) fits here: the finetune role
checks the numbers it resolves to.
"""

from __future__ import annotations

from collections.abc import Sequence


def ranks_mismatch(mpi_ranks: int | str, nodes: Sequence[str], ranks_per_node: int | str) -> str:
    """Empty when ``mpi_ranks`` equals ``len(nodes)`` x ``ranks_per_node``; else what is wrong, with the fix."""
    if isinstance(nodes, str) or not isinstance(nodes, Sequence):
        raise TypeError(f"xeonsd_ranks_mismatch: nodes must be a list of hosts, got {nodes!r}")
    if "auto" in (str(mpi_ranks).strip().lower(), str(ranks_per_node).strip().lower()):
        return ""
    try:
        ranks, per_node = int(mpi_ranks), int(ranks_per_node)
    except (TypeError, ValueError):
        raise ValueError(
            f"xeonsd_ranks_mismatch: mpi_ranks {mpi_ranks!r} and ranks_per_node {ranks_per_node!r} must be integers"
        ) from None
    fits = len(nodes) * per_node
    if ranks == fits:
        return ""
    return (
        f"mpi_ranks is {ranks} but the cluster has {len(nodes)} nodes ({', '.join(nodes)}) x ranks_per_node "
        f"{per_node} = {fits}. Fix: set mpi_ranks to {fits} or change ranks_per_node."
    )


class FilterModule:
    def filters(self) -> dict:
        return {"xeonsd_ranks_mismatch": ranks_mismatch}
