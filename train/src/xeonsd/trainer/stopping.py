"""A job that is told to stop, stops cleanly: SIGTERM (``scancel``, a scheduler's preemption, an operator's
``kill``, mpirun passing on its own), SIGINT (Ctrl-C) and SIGUSR1 (the launcher's warning before its time limit:
Slurm's ``--signal``).

Before the training steps (parsing, model loading, the latent and prompt caches) there is nothing worth saving:
the handler raises :class:`Interrupted` at once, every output being written under a temporary name, so nothing
half-written is left. From the first step on the handler only records the signal (:meth:`StopSignals.defer`); at
each step's end every rank takes part in one all-reduce of one int (the highest signal number any rank got), so
that all of them stop after the same step, however the signal reached them. Then rank 0 writes a checkpoint
there, every rank's status file says ``interrupted`` with the signal and the step, and the process exits with
128 + the signal. A second signal during that is logged and ignored (the checkpoint is written to a temporary
directory and renamed, so even a SIGKILL never leaves a broken one), and a watchdog bounds the whole stop:
past ``XEONSD_STOP_TIMEOUT`` seconds (default 120) the rank exits with the same code without its checkpoint.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping

import torch

from xeonsd.cluster.distributed import collective
from xeonsd.contracts.job_status import Stop
from xeonsd.trainer.config import ConfigError

log = logging.getLogger("xeonsd.train")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# Slurm's --signal=USR1@<seconds>: the warning before the time limit.
TIME_LIMIT_SIGNAL = signal.SIGUSR1
STOP_TIMEOUT_ENV = "XEONSD_STOP_TIMEOUT"
DEFAULT_STOP_TIMEOUT_S = 120.0


class Interrupted(BaseException):  # noqa: N818 - like KeyboardInterrupt: not an error, and no `except Exception` eats it
    """The job was told to stop: ``signum`` and the ``stop`` its status file records."""

    def __init__(self, signum: int, stop: Stop) -> None:
        if stop.checkpoint:
            what = f"at step {stop.step} ({stop.checkpoint} written); resume with --resume_from_checkpoint latest"
        elif stop.step:
            what = f"at step {stop.step}, without a checkpoint"
        else:
            what = "before the first training step (nothing of this attempt was saved)"
        super().__init__(f"stopped by {describe(signum)} {what}")
        self.signum = signum
        self.stop = stop

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)


def exit_code(signum: int) -> int:
    return 128 + signum


def reason(signum: int) -> str:
    return "time_limit" if signum == TIME_LIMIT_SIGNAL else "signal"


def describe(signum: int) -> str:
    """'SIGTERM', or 'the time limit (SIGUSR1)'."""
    name = signal.Signals(signum).name
    return f"the time limit ({name})" if reason(signum) == "time_limit" else name


def make_stop(signum: int, step: int, checkpoint: str | None = None) -> Stop:
    return Stop(signal=signal.Signals(signum).name, reason=reason(signum), step=step, checkpoint=checkpoint)


def stop_timeout_s(env: Mapping[str, str] | None = None) -> float:
    """``XEONSD_STOP_TIMEOUT``: how long the stop (the checkpoint, the status files) may take, in seconds."""
    raw = (os.environ if env is None else env).get(STOP_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_STOP_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"{STOP_TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return value


class StopSignals:
    """The handlers of STOP_SIGNALS for one run: installed by ``install``, put back by ``restore``. Until
    ``defer`` a signal raises :class:`Interrupted` (step 0); after it, only ``signum`` is set (the first signal
    wins, later ones are logged)."""

    def __init__(self) -> None:
        self.signum = 0
        self.deferred = False
        self.timeout_s = DEFAULT_STOP_TIMEOUT_S
        self._previous: dict[int, object] = {}

    def install(self) -> StopSignals:
        """The handlers, and the stop's time bound read from the environment (ConfigError when it is wrong)."""
        try:
            self.timeout_s = stop_timeout_s()
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def defer(self) -> None:
        """The steps begin: from now on a signal stops the job at the next step's end."""
        self.deferred = True

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum:
            log.warning("%s: already stopping on %s; ignored", describe(signum), describe(self.signum))
            return
        self.signum = signum
        if not self.deferred:
            raise Interrupted(signum, make_stop(signum, 0))
        log.warning("%s: finishing this step, then a checkpoint, then exit %d", describe(signum), exit_code(signum))

    def agree(self, world: int) -> int:
        """Every rank at each step's end: the signal all of them stop on (the highest any rank got), 0 for none.
        One all-reduce of one int."""
        flag = torch.tensor([self.signum], dtype=torch.int64)
        if world > 1:
            with collective("all-reduce of the stop flag"):
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        agreed = int(flag.item())
        if agreed and not self.signum:
            self.signum = agreed  # told through a peer; a signal of its own from now on is a second one
        return agreed


class StopDeadline:
    """The bound on a stop once agreed: past ``seconds`` the ``on_expiry`` callback runs (it records the stop
    without its checkpoint) and the process exits with ``code`` at once, whatever it was doing."""

    def __init__(self, seconds: float, code: int, on_expiry: Callable[[], None]) -> None:
        self._timer = threading.Timer(seconds, self._expire, args=(seconds, code, on_expiry))
        self._timer.daemon = True

    def __enter__(self) -> StopDeadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()

    @staticmethod
    def _expire(seconds: float, code: int, on_expiry: Callable[[], None]) -> None:
        log.error(  # a record, not a print: the quiet console shows it too
            "xeonsd train: error: the stop did not finish within %gs (%s); exiting %d without it",
            seconds,
            STOP_TIMEOUT_ENV,
            code,
        )
        try:
            on_expiry()
        finally:
            os._exit(code)
