"""Ranks, process group and CPU placement.

A job is started by Intel MPI / MPICH (``PMI_*``, ``MPI_LOCAL*``), Open MPI (``OMPI_COMM_WORLD_*``), torchrun
(``RANK``/``WORLD_SIZE``/``LOCAL_*``) or by hand (one process). The process group uses ``ccl`` when the oneCCL
bindings import and ``gloo`` otherwise; ``MASTER_ADDR``/``MASTER_PORT`` come from the environment.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
# How long a collective may wait for a peer before the job fails (a dead rank ends the job instead of hanging).
TIMEOUT_ENV = "XEONSD_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 1800


class DistributedError(RuntimeError):
    """The launch environment is inconsistent or the process group could not form."""


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError as exc:
        raise DistributedError(f"environment variable {name}={env[name]!r} is not an integer") from exc


def detect_ranks(env: Mapping[str, str] | None = None) -> RankInfo:
    """Read rank, world size and node-local placement from whichever launcher started us."""
    env = os.environ if env is None else env
    layouts = (
        ("intel-mpi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        ("open-mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
         "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    )  # fmt: skip
    for launcher, r, w, lr, lw in layouts:
        if r in env and w in env:
            rank, world = _int(env, r), _int(env, w)
            local_rank = _int(env, lr) if lr in env else rank
            local_world = _int(env, lw) if lw in env else world
            if not (0 <= rank < world) or not (0 <= local_rank < local_world):
                raise DistributedError(
                    f"{launcher} reports rank {rank} of {world} (local {local_rank} of {local_world}): out of range"
                )
            return RankInfo(rank, world, local_rank, local_world, launcher)
    return RankInfo(0, 1, 0, 1, "single")


def pick_backend() -> str:
    """``ccl`` when the oneCCL bindings for PyTorch import (they register the backend), else ``gloo``."""
    try:
        importlib.import_module("oneccl_bindings_for_pytorch")
    except ImportError:
        return "gloo"
    return "ccl"


def init_process_group(info: RankInfo, backend: str | None = None) -> str | None:
    """Join the job's process group; returns the backend, or ``None`` for a single process."""
    if info.world_size == 1:
        return None
    backend = backend or pick_backend()
    addr = os.environ.get("MASTER_ADDR", DEFAULT_MASTER_ADDR)
    port = int(os.environ.get("MASTER_PORT", DEFAULT_MASTER_PORT))
    timeout = datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
    try:
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{addr}:{port}",
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout,
        )
    except Exception as exc:  # noqa: BLE001 - the c10d errors have no common type; re-raised with a hint
        text = str(exc)
        hint = ""
        if "address already in use" in text.lower() or "EADDRINUSE" in text:
            hint = (
                f" Port {port} on {addr} is already in use (another job, or a stale rank of an earlier one): "
                "set MASTER_PORT to a free port, or end the old job."
            )
        raise DistributedError(
            f"rank {info.rank}: could not join the {backend} process group at {addr}:{port}: {text}.{hint}"
        ) from exc
    return backend


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _physical_cores(allowed: set[int]) -> list[int]:
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
    if narrowed or user_threads:
        cores = _physical_cores(allowed)
        threads = int(user_threads) if user_threads else max(1, len(cores))
        torch.set_num_threads(threads)
        return Placement(threads, tuple(sorted(allowed)), "user" if user_threads else "launcher")
    cores = _physical_cores(allowed)
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


def all_reduce_mean_(buf: torch.Tensor, world_size: int) -> torch.Tensor:
    """Average ``buf`` over all ranks in place (no-op for a single process)."""
    if world_size > 1:
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        buf.div_(world_size)
    return buf


def all_reduce_sum_(buf: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size > 1:
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    return buf


def barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()
