"""Who this rank is and how long it may wait for its peers, from its launcher's environment (standard library
only).

A job is started by Intel MPI / MPICH (``PMI_*``, ``MPI_LOCAL*``), Open MPI (``OMPI_COMM_WORLD_*``), torchrun
(``RANK``/``WORLD_SIZE``/``LOCAL_*``), Slurm's ``srun`` (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``:
where no MPI's variables are set) or by hand (one process). The collective timeouts come from ``XEONSD_DIST_TIMEOUT``
and ``XEONSD_STEP_TIMEOUT``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from xeonsd.cluster.slurm_tasks import tasks_on_node

# How long a collective may wait for a peer before the job fails (a dead rank ends the job instead of hanging).
TIMEOUT_ENV = "XEONSD_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 1800
# A shorter limit for the training steps once every rank is set up (finetune.yml: 45 s): a rank or node that
# dies or stalls mid-run then ends the job within that time. Unset: the steps keep XEONSD_DIST_TIMEOUT.
STEP_TIMEOUT_ENV = "XEONSD_STEP_TIMEOUT"


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
    if name not in env:
        raise DistributedError(f"environment variable {name} is not set")
    try:
        return int(env[name])
    except ValueError as exc:
        raise DistributedError(f"environment variable {name}={env[name]!r} is not an integer") from exc


def detect_ranks(env: Mapping[str, str] | None = None) -> RankInfo:
    """Read rank, world size and node-local placement from whichever launcher started us."""
    env = os.environ if env is None else env
    layouts = (
        ("intel-mpi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        (
            "open-mpi",
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ),
        ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    )
    for launcher, r, w, lr, lw in layouts:
        if r in env and w in env:
            rank, world = _int(env, r), _int(env, w)
            local_rank = _int(env, lr) if lr in env else rank
            local_world = _int(env, lw) if lw in env else world
            return _checked(RankInfo(rank, world, local_rank, local_world, launcher))
    # A task of an srun job step (SLURM_STEP_ID; the batch script itself has SLURM_PROCID=0 and SLURM_NTASKS too).
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        world_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
        rank, world = _int(env, "SLURM_PROCID"), _int(env, world_var)
        local_rank = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else rank
        try:
            local_world = tasks_on_node(env) if "SLURM_LOCALID" in env else world
        except ValueError as exc:
            raise DistributedError(str(exc)) from exc
        return _checked(RankInfo(rank, world, local_rank, local_world, "slurm"))
    return RankInfo(0, 1, 0, 1, "single")


def _checked(info: RankInfo) -> RankInfo:
    if not (0 <= info.rank < info.world_size) or not (0 <= info.local_rank < info.local_world_size):
        raise DistributedError(
            f"{info.launcher} reports rank {info.rank} of {info.world_size} "
            f"(local {info.local_rank} of {info.local_world_size}): out of range"
        )
    return info


def _seconds(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError as exc:
        raise DistributedError(f"{name}={raw!r} is not a number of seconds") from exc
    if value <= 0:
        raise DistributedError(f"{name}={raw!r} must be a positive number of seconds")
    return value


@dataclass(frozen=True)
class Timeouts:
    """How long a collective may wait for its peers: during set-up, and during the training steps."""

    setup_s: float
    step_s: float | None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Timeouts:
        env = os.environ if env is None else env
        return cls(_seconds(env, TIMEOUT_ENV) or DEFAULT_TIMEOUT_S, _seconds(env, STEP_TIMEOUT_ENV))
