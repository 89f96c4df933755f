"""A Slurm batch job's accounting, once it ended: its ``sacct`` line (or, on a cluster without an accounting
database, ``scontrol show job``), read into ``slurm.json`` (schema :class:`xeonsd.contracts.slurm_job.SlurmJob`) by
``xeonsd slurmjob record`` in the finetune role's run.sh."""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import asdict, replace
from pathlib import Path

from xeonsd.contracts.job_status import StatusFileError, read_exit, write_json
from xeonsd.contracts.slurm_job import SLURM_FILE, WARNING_SIGNAL, SlurmJob

# sacct's fields, in this order (-P: separated by |).
SACCT_FIELDS = ("JobID", "State", "ExitCode", "ElapsedRaw", "TotalCPU", "CPUTimeRAW", "NodeList", "TimelimitRaw")
# What sacct says on a cluster without an accounting database.
ACCOUNTING_DISABLED = "accounting storage is disabled"
# States of a job that has not ended yet (sacct shows these for a moment after sbatch --wait returns).
_UNFINISHED = ("PENDING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED")
_CPU_TIME = re.compile(r"^(?:(?:(?P<d>\d+)-)?(?P<h>\d+):)?(?P<m>\d+):(?P<s>\d+(?:\.\d+)?)$")


def cpu_seconds(text: str) -> float:
    """sacct's TotalCPU ([DD-[HH:]]MM:SS[.mmm]) in seconds."""
    m = _CPU_TIME.match(text.strip())
    if not m:
        raise StatusFileError(f"sacct TotalCPU {text!r}: expected [DD-[HH:]]MM:SS[.mmm]")
    return round(int(m["d"] or 0) * 86400 + int(m["h"] or 0) * 3600 + int(m["m"]) * 60 + float(m["s"]), 3)


def parse_sacct(text: str, job_id: str) -> SlurmJob | None:
    """The job's own line of ``sacct -n -P -o <SACCT_FIELDS> -j ID`` (its steps' lines are ignored: the job's
    TotalCPU already sums them); None while the job has not ended or sacct has no line for it yet."""
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != len(SACCT_FIELDS) or fields[0] != job_id:
            continue
        row = dict(zip(SACCT_FIELDS, fields, strict=True))
        state = row["State"].split()[0] if row["State"].strip() else ""
        if not state or state in _UNFINISHED:
            return None
        try:
            exit_code = int(row["ExitCode"].split(":")[0])
            limit = int(row["TimelimitRaw"]) * 60 if row["TimelimitRaw"].isdigit() else None
            return SlurmJob(
                job_id=job_id,
                state=state,
                exit_code=exit_code,
                elapsed_s=int(row["ElapsedRaw"]),
                cpu_time_s=cpu_seconds(row["TotalCPU"]),
                allocated_cpu_s=int(row["CPUTimeRAW"]),
                nodes=row["NodeList"],
                time_limit_s=limit,
                stopped_by_time_limit=state == "TIMEOUT" or exit_code == 128 + WARNING_SIGNAL,
            )
        except ValueError as exc:
            raise StatusFileError(f"sacct line for job {job_id} {line.strip()!r}: {exc}") from exc
    return None


def _duration_s(text: str) -> int:
    """scontrol's [DD-]HH:MM:SS (or MM:SS) in seconds."""
    days, _, clock = text.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    return int(days or 0) * 86400 + sum(p * m for p, m in zip(reversed(parts), (1, 60, 3600), strict=False))


def parse_scontrol(text: str, job_id: str) -> SlurmJob | None:
    """The ended job from ``scontrol show job -o ID`` (slurmctld keeps an ended job for MinJobAge, 300 s by
    default): what a cluster without accounting can tell, its CPU time unknown; None while it has not ended."""
    fields = dict(token.partition("=")[::2] for token in text.split() if "=" in token)
    if fields.get("JobId") != job_id:
        return None
    state = fields.get("JobState", "")
    if not state or state in _UNFINISHED:
        return None
    try:
        exit_code = int(fields["ExitCode"].split(":")[0])
        elapsed = _duration_s(fields["RunTime"])
        limit = fields.get("TimeLimit", "UNLIMITED")
        return SlurmJob(
            job_id=job_id,
            state=state,
            exit_code=exit_code,
            elapsed_s=elapsed,
            cpu_time_s=None,
            allocated_cpu_s=int(fields.get("NumCPUs", "0")) * elapsed,
            nodes=fields.get("NodeList", ""),
            time_limit_s=None if limit in ("UNLIMITED", "Partition_Limit") else _duration_s(limit),
            stopped_by_time_limit=state == "TIMEOUT" or exit_code == 128 + WARNING_SIGNAL,
            source="scontrol",
        )
    except (KeyError, ValueError) as exc:
        raise StatusFileError(f"scontrol show job {job_id} {text.strip()!r}: {exc}") from exc


def query(job_id: str, wait_s: float = 60, poll_s: float = 2, run=subprocess.run) -> SlurmJob:
    """The ended job's accounting, asked of sacct until it has the final line (slurmctld hands it to slurmdbd a
    moment after the job ends); StatusFileError naming sacct's answer when it never comes."""
    sacct = ["sacct", "-n", "-P", "-j", job_id, "-o", ",".join(SACCT_FIELDS)]
    deadline = time.monotonic() + wait_s
    while True:
        proc = run(sacct, text=True, capture_output=True, check=False)
        if proc.returncode == 0:
            job = parse_sacct(proc.stdout, job_id)
            if job is not None:
                return job
        # Without slurmdbd (AccountingStorageType none: the slurm role's default) sacct never has a line; slurmctld
        # still knows the ended job for a while.
        if ACCOUNTING_DISABLED in proc.stderr:
            shown = run(["scontrol", "show", "job", "-o", job_id], text=True, capture_output=True, check=False)
            job = parse_scontrol(shown.stdout, job_id) if shown.returncode == 0 else None
            if job is not None:
                return job
        if time.monotonic() > deadline or ACCOUNTING_DISABLED in proc.stderr:
            said = (proc.stderr or proc.stdout).strip() or "no line for the job"
            raise StatusFileError(
                f"sacct has no final accounting of Slurm job {job_id} after {wait_s:g} s (rc {proc.returncode}: "
                f"{said}). Fix: check that Slurm's accounting (slurmdbd) runs: sacct -j {job_id}"
            )
        time.sleep(poll_s)


def record(run_dir: Path, job_id: str, wait_s: float = 60, run=subprocess.run) -> SlurmJob:
    """slurm.json of the ended job. Stopped by the time limit also when the ranks said so (exit.json's stop, which
    run.sh wrote just before): srun's own exit code after the ranks' 138 is not always 138 (seen: 15, once its
    --kill-on-bad-exit had sent the last ranks SIGTERM)."""
    job = query(job_id, wait_s=wait_s, run=run)
    ended = read_exit(Path(run_dir))
    if ended is not None and ended.stopped is not None and ended.stopped.reason == "time_limit":
        job = replace(job, stopped_by_time_limit=True)
    write_json(Path(run_dir) / SLURM_FILE, asdict(job), fsync=True)
    return job


def summary(job: SlurmJob) -> str:
    """One line for people: the job, how it ended, its elapsed and CPU time."""
    cpu = "not recorded (no Slurm accounting)" if job.cpu_time_s is None else f"{job.cpu_time_s:.0f} s"
    line = (
        f"Slurm job {job.job_id}: {job.state} (exit {job.exit_code}), elapsed {job.elapsed_s} s, "
        f"CPU time {cpu} of {job.allocated_cpu_s} s allocated"
    )
    if job.stopped_by_time_limit:
        line += "; stopped by the time limit: resume with -e resume=latest"
    return line
