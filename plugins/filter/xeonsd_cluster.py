"""xeonsd_ranks_mismatch: the one rule of the job's shape, mpi_ranks == nodes x ranks_per_node.

mpirun starts ``-n mpi_ranks`` ranks, ``-ppn ranks_per_node`` on each node of the nodefile; any other total leaves
nodes idle or piles ranks onto the first ones. Preflight refuses such an inventory, the finetune role checks it
again for -e overrides, and doctor's nodefile row reports it: all three with this filter and its message.
``auto`` in either (ranks_per_node: the tuned layout, plugins/filter/xeonsd_layout.py) fits here: the finetune role
checks the numbers it resolves to.

xeonsd_probe_targets: the hosts' addresses and ports as preflight's xeonsd_tcp_probe module takes them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


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


def probe_targets(
    hosts: Sequence[str], hostvars: Mapping, address: str, port: str | None, default_port: int | str
) -> list[dict]:
    """``[{name, host, port}]`` for ``hosts``: the host at its ``hostvars`` variable ``address`` (default: its
    inventory name, as Ansible connects) and port ``port`` (default ``default_port``; None: always it)."""
    if isinstance(hosts, str) or not isinstance(hosts, Sequence):
        raise TypeError(f"xeonsd_probe_targets: hosts must be a list of hosts, got {hosts!r}")
    out = []
    for name in hosts:
        hv = hostvars[name]
        value = hv.get(port, default_port) if port else default_port
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"xeonsd_probe_targets: {name}'s port {value!r} is not a number") from None
        out.append({"name": name, "host": str(hv.get(address, name)), "port": number})
    return out


class FilterModule:
    def filters(self) -> dict:
        return {"xeonsd_ranks_mismatch": ranks_mismatch, "xeonsd_probe_targets": probe_targets}
