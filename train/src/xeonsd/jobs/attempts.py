"""What run.sh and the play do to a job's attempt, through ``xeonsd jobstatus``: ``begin`` (attempt.json, before
mpirun or sbatch), ``exit`` (exit.json, after it) and ``stop`` (SIGTERM to the running run.sh, which stops the
ranks cleanly at a checkpoint). The files' schema is :mod:`xeonsd.contracts.job_status`."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import asdict
from pathlib import Path

from xeonsd.contracts.job_status import (
    ATTEMPT_FILE,
    EXIT_FILE,
    LOG_FILE,
    RUN_PID_FILE,
    RUN_SCRIPT,
    Attempt,
    ExitStatus,
    StatusFileError,
    Stop,
    rank_status_path,
    read_attempt,
    read_rank_status,
    write_json,
)

# ---- run.sh's side: `xeonsd jobstatus begin RUN_DIR` and `xeonsd jobstatus exit RUN_DIR --rc RC` -------------


def begin_attempt(run_dir: Path, now: float | None = None, time_limit_s: int | None = None) -> Attempt:
    """The next attempt of the run in ``run_dir`` (1 for a new run), recorded in attempt.json with where its part
    of train.log starts."""
    previous = read_attempt(run_dir)
    log_file = Path(run_dir) / LOG_FILE
    attempt = Attempt(
        attempt=(previous.attempt if previous else 0) + 1,
        started=int(now or time.time()),
        log_offset=log_file.stat().st_size if log_file.is_file() else 0,
        time_limit_s=time_limit_s,
    )
    write_json(Path(run_dir) / ATTEMPT_FILE, asdict(attempt), fsync=True)
    return attempt


def _stopped(run_dir: Path, attempt: int) -> Stop | None:
    """Rank 0's Stop, when its status file (on the primary, where run.sh runs) says this attempt stopped."""
    try:
        status = read_rank_status(rank_status_path(run_dir, 0))
    except (OSError, StatusFileError):
        return None
    return status.stop if status.attempt == attempt and status.state == "interrupted" else None


def write_exit(run_dir: Path, rc: int, now: float | None = None) -> ExitStatus:
    """How the current attempt ended (its number and start from attempt.json; a stopped one's Stop), in exit.json."""
    attempt = read_attempt(run_dir)
    if attempt is None:
        raise StatusFileError(f"{Path(run_dir) / ATTEMPT_FILE} does not exist: run `xeonsd jobstatus begin` first")
    ended = int(now or time.time())
    timed_out = rc != 0 and attempt.time_limit_s is not None and ended - attempt.started >= attempt.time_limit_s
    status = ExitStatus(
        rc, attempt.started, ended, attempt.attempt, timed_out, _stopped(run_dir, attempt.attempt) if rc else None
    )
    write_json(Path(run_dir) / EXIT_FILE, asdict(status), fsync=True)
    return status


# ---- the play's side of a stop: `xeonsd jobstatus stop RUN_DIR` (Ctrl-C on the controller, xeonsd_job stop) ----


def _job_pid(run_dir: Path) -> tuple[int | None, str]:
    """The pid of the run's running run.sh, or None and why there is none."""
    pid_file = Path(run_dir) / RUN_PID_FILE
    try:
        pid = int(pid_file.read_text().strip())
    except FileNotFoundError:
        return None, f"{pid_file} does not exist: the job never started"
    except ValueError:
        return None, f"{pid_file} holds no pid"
    script = Path(run_dir).resolve() / RUN_SCRIPT
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None, f"the job has ended (run.sh, pid {pid}, is gone)"
    if not any(arg.endswith(RUN_SCRIPT) and Path(arg).resolve() == script for arg in argv):
        return None, f"the job has ended (pid {pid} is now another process, not {script})"
    return pid, ""


def stop_job(run_dir: Path) -> dict:
    """SIGTERM to the run's run.sh when it is running: every rank stops after the same step, rank 0 writes a
    checkpoint there and the attempt exits 143 (the poll then reports the stop). Returns ``signalled``, ``pid``
    and ``message``."""
    pid, why = _job_pid(run_dir)
    if pid is None:
        return {"signalled": False, "pid": None, "message": f"nothing to stop: {why}"}
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return {"signalled": False, "pid": pid, "message": f"nothing to stop: the job ended (pid {pid})"}
    return {
        "signalled": True,
        "pid": pid,
        "message": f"SIGTERM sent to the job (run.sh, pid {pid}): the ranks stop after their current step and "
        "rank 0 writes a checkpoint there",
    }
