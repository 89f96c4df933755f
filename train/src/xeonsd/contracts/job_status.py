"""What a training job tells the playbooks, as small JSON files whose schema is defined here once.

* ``<output_dir>/status/rank-<r>.json`` (:class:`RankStatus`): one per rank, on that rank's own node (the run
  directory has the same path on every node). The trainer writes it at start-up, on every state change
  (starting → running → saving → done, or failed, or interrupted), after every step, and on every fatal error
  path with the error's kind: ``input`` (bad input, a clear message), ``exception`` (a traceback), ``lost_peer`` (a
  collective failed: a peer died or went away; ``peer`` is its address when the backend named it) or ``timeout``
  (a collective waited past its limit). A job told to stop (SIGTERM, SIGINT, SIGUSR1: :mod:`xeonsd.trainer.stopping`)
  ends ``interrupted`` with its :class:`Stop`: the signal, why (``time_limit`` for SIGUSR1, the launcher's warning
  before its time limit), and the checkpoint written at that step; it exits with 128 + the signal.
* ``<run_dir>/attempt.json`` (:class:`Attempt`) and ``<run_dir>/exit.json`` (:class:`ExitStatus`): written by the
  finetune role's ``run.sh`` through ``xeonsd jobstatus begin`` / ``xeonsd jobstatus exit`` around mpirun. Each
  attempt of a run (a resumed run is a new attempt in the same directory) gets the next number; run.sh exports it
  as ``XEONSD_ATTEMPT`` so that every rank's status file says which attempt wrote it, and readers ignore files
  left by an earlier one. An attempt that was stopped has rank 0's :class:`Stop` in exit.json too.

Who acts on them: the trainer's ranks keep their status files (:mod:`xeonsd.jobs.status_file`); run.sh's ``begin``
and ``exit`` and the play's ``stop`` are :mod:`xeonsd.jobs.attempts`; the finetune role reads them only through
``xeonsd jobstatus`` (:mod:`xeonsd.jobs.cli`), run in the node's diffuser env: ``poll`` (the progress line, and who
ended a failed job or how a stopped one stopped: :mod:`xeonsd.jobs.watch`), ``ranks`` (a node's rank status files)
and ``codes`` (the exit codes the role tells apart, :data:`EXIT_CODES`), all with JSON on stdout. Nothing else in
the repository restates the schema or the codes.

Every file is written under a temporary name and renamed into place, so a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

SCHEMA_VERSION = 1
STATUS_DIR = "status"
ATTEMPT_FILE = "attempt.json"
EXIT_FILE = "exit.json"
ATTEMPT_ENV = "XEONSD_ATTEMPT"
MEMORY_FIELDS = ("pss_bytes", "shared_bytes", "private_bytes")  # RankStatus's memory figures
STATES = ("starting", "running", "saving", "done", "failed", "interrupted")
# Why a job was told to stop: SIGUSR1 is the launcher's warning before its time limit (Slurm's --signal), the
# others an operator's, a scheduler's or mpirun's SIGTERM, or a Ctrl-C.
STOP_REASONS = ("signal", "time_limit")
ERROR_KINDS = ("input", "exception", "lost_peer", "timeout")
# Errors that are the rank's own (it is the cause); the others are what a rank saw of a peer (it is a witness).
OWN_ERROR_KINDS = ("input", "exception")
# run.sh's exit code when another finetune holds the run lock (flock --conflict-exit-code): nothing was started.
LOCK_CONFLICT_RC = 75
# The exit codes the playbooks tell apart, by name: the finetune role reads them from `xeonsd jobstatus codes`.
# A job that stopped when told to exits with 128 + the signal.
EXIT_CODES = {"lock_conflict": LOCK_CONFLICT_RC, "sigint": 130, "sigusr1": 138, "sigterm": 143}
# The job's human log in the run directory (every rank's lines, mpirun -l): attempt.json says where each attempt's
# part of it starts.
LOG_FILE = "train.log"
# run.sh writes its own pid here; a SIGTERM to it stops the job cleanly (mpirun: passed on to mpiexec.hydra and the
# ranks; Slurm: scancel --signal=TERM of the batch job's steps). `xeonsd jobstatus stop` sends it.
RUN_PID_FILE = "run.pid"
RUN_SCRIPT = "run.sh"


class StatusFileError(ValueError):
    """A status file that is missing a field, has a wrong value, or was written by another schema version."""


@dataclass(frozen=True)
class LastError:
    kind: str  # one of ERROR_KINDS
    message: str
    peer: str | None = None  # the address of the peer a lost_peer error names, when the backend named it

    def __post_init__(self) -> None:
        if self.kind not in ERROR_KINDS:
            raise StatusFileError(f"error kind {self.kind!r} is not one of {', '.join(ERROR_KINDS)}")


@dataclass(frozen=True)
class Stop:
    """How a job that was told to stop ended: the signal's name, why (one of STOP_REASONS), the step it stopped
    at (every rank the same) and the checkpoint written there (its directory name; None before the first step)."""

    signal: str
    reason: str
    step: int
    checkpoint: str | None = None

    def __post_init__(self) -> None:
        if self.reason not in STOP_REASONS:
            raise StatusFileError(f"stop reason {self.reason!r} is not one of {', '.join(STOP_REASONS)}")


@dataclass(frozen=True)
class RankStatus:
    rank: int
    world: int
    node: str  # the inventory's name for this node (XEONSD_NODE_NAMES), else its address
    address: str  # this node's address on the job's network
    pid: int
    state: str  # one of STATES
    step: int  # optimizer steps done
    updated: float  # Unix time of this write
    attempt: int | None = None  # run.sh's attempt number (XEONSD_ATTEMPT); None when started by hand
    error: LastError | None = None
    stop: Stop | None = None  # state interrupted: how it stopped
    # This rank's memory as the kernel shares it (xeonsd.cluster.memory), at the end of loading and at each stats
    # interval: PSS, and the resident bytes shared with other processes and its own. None: not measured (yet).
    pss_bytes: int | None = None
    shared_bytes: int | None = None
    private_bytes: int | None = None
    schema: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise StatusFileError(f"state {self.state!r} is not one of {', '.join(STATES)}")
        if not 0 <= self.rank < self.world:
            raise StatusFileError(f"rank {self.rank} is out of range for world size {self.world}")
        for name in MEMORY_FIELDS:
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise StatusFileError(f"{name} must be a number of bytes (an integer >= 0) or null, got {value!r}")


@dataclass(frozen=True)
class Attempt:
    attempt: int
    started: int  # Unix time
    log_offset: int = 0  # train.log's size when this attempt began: its lines start there
    time_limit_s: int | None = None  # the job's time limit (I_MPI_JOB_TIMEOUT), when run.sh set one
    schema: int = SCHEMA_VERSION


@dataclass(frozen=True)
class ExitStatus:
    rc: int  # mpirun's exit code (LOCK_CONFLICT_RC: another finetune held the lock)
    started: int  # Unix time
    ended: int
    attempt: int | None = None
    timed_out: bool = False  # it failed having run for its whole time limit (mpirun ended it)
    stopped: Stop | None = None  # rank 0's Stop, when the attempt stopped as it was told to
    schema: int = SCHEMA_VERSION


def field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def rank_status_path(output_dir: Path, rank: int) -> Path:
    return Path(output_dir) / STATUS_DIR / f"rank-{rank}.json"


def write_json(path: Path, data: dict, fsync: bool = False) -> None:
    """Write ``data`` to a temporary file beside ``path`` and rename it into place (fsync for files that must
    survive a power loss too; a rank's per-step status need not)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, sort_keys=True)
            fh.write("\n")
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _typed(cls: type, data: object, where: str):
    if not isinstance(data, dict):
        raise StatusFileError(f"{where}: expected a JSON object, got {type(data).__name__}")
    if data.get("schema") != SCHEMA_VERSION:
        raise StatusFileError(
            f"{where}: schema {data.get('schema')!r}, this role reads schema {SCHEMA_VERSION} "
            "(the trainer and the playbooks are of different versions)"
        )
    names = field_names(cls)
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise StatusFileError(f"{where}: missing field(s) {', '.join(missing)}")
    try:
        return cls(**{n: data[n] for n in names if n in data})
    except TypeError as exc:
        raise StatusFileError(f"{where}: {exc}") from exc


def rank_status_from_dict(data: object, where: str = "rank status") -> RankStatus:
    status = _typed(RankStatus, data, where)
    if status.error is not None:
        status = dataclasses.replace(status, error=_typed_part(LastError, status.error, where, "error"))
    if status.stop is not None:
        status = dataclasses.replace(status, stop=_typed_part(Stop, status.stop, where, "stop"))
    return status


def _typed_part(cls: type, data: object, where: str, name: str):
    """A nested object of a status file (``error``, ``stop``), or StatusFileError naming what it lacks."""
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
    if not isinstance(data, dict) or not set(required) <= data.keys():
        raise StatusFileError(f"{where}: {name} must be an object with {', '.join(required)}, got {data!r}")
    return cls(**{n: data[n] for n in field_names(cls) if n in data})


def read_json(path: Path) -> object:
    """The JSON in the file at ``path``; StatusFileError when it is not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except ValueError as exc:
        raise StatusFileError(f"{path}: not JSON ({exc})") from exc


def read_rank_status(path: Path) -> RankStatus:
    return rank_status_from_dict(read_json(path), str(path))


def read_attempt(run_dir: Path) -> Attempt | None:
    path = Path(run_dir) / ATTEMPT_FILE
    return _typed(Attempt, read_json(path), str(path)) if path.exists() else None


def read_exit(run_dir: Path) -> ExitStatus | None:
    path = Path(run_dir) / EXIT_FILE
    if not path.exists():
        return None
    ended = _typed(ExitStatus, read_json(path), str(path))
    if ended.stopped is not None:
        ended = dataclasses.replace(ended, stopped=_typed_part(Stop, ended.stopped, str(path), "stopped"))
    return ended


def attempt_from_env(env: dict[str, str] | None = None) -> int | None:
    raw = (os.environ if env is None else env).get(ATTEMPT_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise StatusFileError(f"{ATTEMPT_ENV}={raw!r} is not an attempt number")
    return int(raw)
