"""A rank's status file (``status/rank-<r>.json``, schema :class:`xeonsd.contracts.job_status.RankStatus`), as the
trainer's rank keeps it: rewritten in place on every state change, after every step, and with the rank's memory
figures at the end of loading and at each stats interval."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import asdict
from pathlib import Path

from xeonsd.contracts.job_status import LastError, RankStatus, Stop, rank_status_path, write_json

log = logging.getLogger(__name__)


class RankStatusFile:
    """One rank's status file, rewritten in place on every change. A write that fails (a full or read-only disk)
    is logged once and never stops the training: the file is what the playbooks read, not what the job needs."""

    def __init__(self, output_dir: Path, status: RankStatus) -> None:
        self.path = rank_status_path(output_dir, status.rank)
        self.status = status
        self._warned = False
        self._accepted = False
        self._write()

    def accept(self) -> None:
        """The run's inputs passed their checks: from now on the file is written even where the output dir does not
        exist yet (a worker node's copy of the run dir)."""
        self._accepted = True
        self._write()

    def update(self, *, state: str | None = None, step: int | None = None, error: LastError | None = None) -> None:
        given = {"state": state, "step": step, "error": error}
        self._change(**{k: v for k, v in given.items() if v is not None})

    def _change(self, **fields: object) -> None:
        """The status with these fields changed and written now."""
        self.status = dataclasses.replace(self.status, updated=time.time(), **fields)
        self._write()

    def record_memory(self, pss_bytes: int, shared_bytes: int, private_bytes: int) -> None:
        """This rank's memory figures now (:mod:`xeonsd.cluster.memory`): kept until the next ones."""
        self._change(pss_bytes=pss_bytes, shared_bytes=shared_bytes, private_bytes=private_bytes)

    def fail(self, kind: str, message: str, peer: str | None = None) -> None:
        self.update(state="failed", error=LastError(kind, message, peer))

    def interrupt(self, stop: Stop) -> None:
        self._change(state="interrupted", step=stop.step, stop=stop)

    def _write(self) -> None:
        # Always in a launched job's attempt (run.sh sets XEONSD_ATTEMPT; the play reads the file, also for a rank
        # refused on its inputs), into an output dir that exists, or once the inputs were accepted (``accept``):
        # a run by hand refused on its inputs before it had an output dir leaves nothing behind.
        if not (self.status.attempt is not None or self._accepted or self.path.parent.parent.is_dir()):
            return
        try:
            write_json(self.path, asdict(self.status), fsync=self.status.state in ("done", "failed", "interrupted"))
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning(
                    "cannot write the rank status file %s (%s); the play's diagnosis will miss it", self.path, exc
                )
