"""``xeonsd hello``: every rank of an mpirun job joins the trainer's process group and answers.

Run it the way the training job runs (``mpirun -f NODEFILE -n N -ppn K xeonsd hello --expect-ranks N``): each
rank joins the same process group the trainer uses (``MASTER_ADDR``/``MASTER_PORT``, ccl or gloo), all-reduces
one number and all-gathers where it runs. Rank 0 prints one line per node and a summary line; the exit code is 1
when the group does not form, a collective fails, or the world is not the one expected.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import dataclass

from xeonsd.cluster.distributed import (
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    destroy_process_group,
    init_process_group,
    node_address,
    take_the_job_down,
)
from xeonsd.cluster.launch import TIMEOUT_ENV, DistributedError, RankInfo, detect_ranks


@dataclass(frozen=True)
class Member:
    rank: int
    local_rank: int
    address: str
    hostname: str
    pid: int


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds ``address`` (None when no interface does)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def gloo_loopback_hint(route: str) -> str | None:
    """Why gloo cannot connect across nodes here, when that is the reason: with no GLOO_SOCKET_IFNAME, gloo
    listens on the address the hostname resolves to, and a hostname that resolves to loopback (127.0.1.1 in many
    /etc/hosts) gives the other nodes an address they cannot reach."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or route.startswith("127."):
        return None
    host = socket.gethostname()
    try:
        resolved = socket.gethostbyname(host)
    except OSError:
        return None
    if not resolved.startswith("127."):
        return None
    iface = interface_of(route) or "the MPI network's interface"
    return (
        f"gloo listens on {resolved}, because this node's hostname {host!r} resolves to loopback, and ranks on "
        f"other nodes cannot reach that: export GLOO_SOCKET_IFNAME={iface} in the job's environment (env.sh)"
    )


def node_lines(members: list[Member]) -> list[str]:
    """One line per node (by address), nodes in the order of their lowest rank."""
    nodes: dict[str, list[Member]] = {}
    for m in sorted(members, key=lambda m: m.rank):
        nodes.setdefault(m.address, []).append(m)
    lines = []
    for address, ms in nodes.items():
        ranks = " ".join(str(m.rank) for m in ms)
        hosts = ",".join(sorted({m.hostname for m in ms}))
        pids = ",".join(str(m.pid) for m in ms)
        lines.append(f"{address}: ranks {ranks} (host {hosts}, pids {pids})")
    return lines


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def run(info: RankInfo, expect_ranks: int | None, expect_nodes: int | None) -> tuple[int, list[str]]:
    """Join, all-reduce, all-gather. Returns (exit code, lines for rank 0 to print); errors go to stderr."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    addr = os.environ.get("MASTER_ADDR", DEFAULT_MASTER_ADDR)
    port = int(os.environ.get("MASTER_PORT", DEFAULT_MASTER_PORT))
    me = Member(info.rank, info.local_rank, node_address(addr), socket.gethostname(), os.getpid())
    if info.world_size == 1 and (expect_ranks or 1) > 1:
        return 1, [
            f"xeonsd hello: error: started as a single process ({info.launcher}), expected {expect_ranks} ranks: "
            "run it under mpirun (mpirun -f NODEFILE -n N -ppn K xeonsd hello)"
        ]
    backend = init_process_group(info)
    try:
        value = torch.tensor([float(info.rank + 1)], dtype=torch.float64)
        members: list[Member | None] = [None] * info.world_size
        if backend is None:
            members = [me]
        else:
            try:
                dist.all_reduce(value, op=dist.ReduceOp.SUM)
                dist.all_gather_object(members, me)
            except Exception as exc:  # noqa: BLE001 - c10d errors have no common type; reported with the rank
                raise DistributedError(
                    f"rank {info.rank}: a collective over the {backend} process group at {addr}:{port} failed: {exc}"
                ) from exc
    finally:
        destroy_process_group()
    total = value.item()
    expected_sum = info.world_size * (info.world_size + 1) / 2
    gathered = [m for m in members if m is not None]
    n_nodes = len({m.address for m in gathered})
    lines = node_lines(gathered)
    errors = []
    if total != expected_sum:
        errors.append(f"all-reduce gave sum={total:g}, expected {expected_sum:g}: ranks disagree on the world")
    if expect_ranks is not None and info.world_size != expect_ranks:
        errors.append(
            f"the job has {_plural(info.world_size, 'rank')}, expected {expect_ranks}: check mpirun -n and the nodefile"
        )
    if expect_nodes is not None and n_nodes != expect_nodes:
        errors.append(
            f"the ranks run on {_plural(n_nodes, 'node')}, expected {expect_nodes}: check the nodefile and mpirun -ppn"
        )
    verdict = "all-reduce ok" if total == expected_sum else "all-reduce WRONG"
    lines.append(
        f"hello: {_plural(info.world_size, 'rank')} on {_plural(n_nodes, 'node')}, "
        f"backend {backend or 'none (single process)'}, {verdict} (sum={total:g})"
    )
    lines += [f"xeonsd hello: error: {e}" for e in errors]
    return (1 if errors else 0), lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="xeonsd hello", description=__doc__.splitlines()[0])
    parser.add_argument("--expect-ranks", type=int, help="fail unless the job has exactly this many ranks")
    parser.add_argument("--expect-nodes", type=int, help="fail unless the ranks run on exactly this many nodes")
    parser.add_argument(
        "--timeout", type=float, default=120, help="seconds to wait for every rank to join (default 120)"
    )
    args = parser.parse_args(argv)
    os.environ[TIMEOUT_ENV] = str(args.timeout)
    try:
        info = detect_ranks()
    except DistributedError as exc:
        print(f"xeonsd hello: error: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        rc, lines = run(info, args.expect_ranks, args.expect_nodes)
    except DistributedError as exc:
        print(f"xeonsd hello: error: {exc}", file=sys.stderr, flush=True)
        addr = os.environ.get("MASTER_ADDR", DEFAULT_MASTER_ADDR)
        hint = gloo_loopback_hint(node_address(addr))
        if hint:
            print(f"xeonsd hello: error: {hint}", file=sys.stderr, flush=True)
        # The other ranks may be blocked waiting for this one: ask mpirun to end them all now.
        take_the_job_down(info, 1)
        return 1
    if info.rank == 0:
        for line in lines:
            print(line, file=sys.stderr if line.startswith("xeonsd hello: error:") else sys.stdout, flush=True)
    return rc
