"""A training job that ran under Slurm (finetune_launcher: slurm): its job id and accounting, in ``slurm.json``.

The finetune role's run.sh submits the batch job with ``sbatch --parsable --wait`` and, once it ended, runs ``xeonsd
slurmjob record RUN_DIR --job-id ID`` (:mod:`xeonsd.jobs.slurm`): the job's ``sacct`` line (state, exit code, elapsed
and CPU time) is written to ``<run_dir>/slurm.json`` (:class:`SlurmJob`, schema defined here once). ``run.json``
and the report show it (:mod:`.run_files`); ``stopped_by_time_limit`` says that Slurm stopped the job at its time
limit: either it ended it (``TIMEOUT``) or the ranks stopped on the warning signal the batch job asks for before it
(``--signal=USR1@…``).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

from xeonsd.contracts.job_status import StatusFileError, read_json

SLURM_FILE = "slurm.json"
SCHEMA_VERSION = 1
# The warning signal the batch job asks for before its time limit (sbatch --signal): the ranks checkpoint and stop.
WARNING_SIGNAL = signal.SIGUSR1


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    state: str  # sacct's State of the job (COMPLETED, FAILED, TIMEOUT, CANCELLED, ...; "CANCELLED by N" → CANCELLED)
    exit_code: int  # the batch script's exit code (sacct's ExitCode before the colon)
    elapsed_s: int  # wall time of the allocation (ElapsedRaw)
    cpu_time_s: float | None  # CPU time the job's processes used (TotalCPU: user + system); None without sacct
    allocated_cpu_s: int  # CPUs allocated x elapsed (CPUTimeRAW)
    nodes: str  # NodeList, Slurm's compressed form
    time_limit_s: int | None  # TimelimitRaw (minutes) in seconds; None when unlimited
    stopped_by_time_limit: bool
    schema: int = SCHEMA_VERSION
    # Where it came from: "sacct" (the accounting database), or "scontrol" on a cluster without one (no CPU time).
    source: str = "sacct"


def read_slurm_job(run_dir: Path) -> SlurmJob | None:
    """slurm.json of a run that ran under Slurm; None for a run launched by mpirun."""
    path = Path(run_dir) / SLURM_FILE
    if not path.exists():
        return None
    data = read_json(path)
    if not isinstance(data, dict) or data.get("schema") != SCHEMA_VERSION:
        raise StatusFileError(f"{path}: not a slurm.json of schema {SCHEMA_VERSION}")
    try:
        return SlurmJob(**data)
    except TypeError as exc:
        raise StatusFileError(f"{path}: {exc}") from exc
