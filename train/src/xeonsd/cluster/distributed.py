"""The job's process group, its collectives, and what a rank does when a peer is lost.

The ranks (who is who: :mod:`.launch`) join the process group with ``ccl`` when the oneCCL bindings import and
``gloo`` otherwise; ``MASTER_ADDR``/``MASTER_PORT`` come from the environment. A collective that fails raises
:class:`PeerLostError`; one that waits past its limit is ended by :class:`CollectiveTimeout`'s watchdog; and a rank
that gives up under Intel MPI takes the whole job down (:func:`take_the_job_down`).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from xeonsd.cluster.launch import DistributedError, RankInfo, Timeouts

log = logging.getLogger(__name__)

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500


class PeerLostError(DistributedError):
    """A collective failed: another rank died, its node went away, or it stalled past the timeout. ``peer`` is
    the address of the peer the backend named, when it named one."""

    def __init__(self, message: str, peer: str | None = None) -> None:
        super().__init__(message)
        self.peer = peer


# How gloo names the other end of a connection that failed: "Connection closed by peer [10.0.0.13]:4000",
# "Read error [10.0.0.13]:51234: Connection reset by peer".
_PEER_ADDRESS = re.compile(r"\[(\d{1,3}(?:\.\d{1,3}){3})\]:\d+")


def peer_address(backend_error: str) -> str | None:
    """The peer address a backend's error message names (gloo's ``[address]:port``), or None."""
    m = _PEER_ADDRESS.search(backend_error)
    return m.group(1) if m else None


class CollectiveTimeout:
    """Dead-peer detection that works with any backend (gloo, ccl): a watchdog thread ends the job when one
    collective waits longer than the limit in force.

    ``with limit.scope(s):`` applies ``s`` seconds to the collectives inside the block (and restores the previous
    limit after it); ``with limit.watch("all-reduce"):`` around a collective puts it under the watchdog. When the
    limit passes, ``on_expiry`` gets the message (it reports it and ends the job; the blocked collective never
    returns). Nothing runs for a single process."""

    def __init__(self, world_size: int, initial_s: float, on_expiry=None, poll_s: float = 0.5) -> None:
        self.world_size = world_size
        self.current = initial_s
        self.on_expiry = on_expiry
        self.poll_s = poll_s
        self._watched: tuple[str, float] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @contextlib.contextmanager
    def scope(self, seconds: float | None) -> Iterator[None]:
        previous = self.current
        if seconds is not None:
            self.current = seconds
        try:
            yield
        finally:
            self.current = previous

    @contextlib.contextmanager
    def watch(self, what: str, extra_s: float = 0.0) -> Iterator[None]:
        """Put the block under the watchdog; ``extra_s`` adds time for work of its own (a backward pass during
        which DistributedDataParallel all-reduces its buckets)."""
        if self.world_size < 2 or self.on_expiry is None:
            yield
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="collective-watchdog", daemon=True)
            self._thread.start()
        self._watched = (what, time.monotonic() + extra_s)
        try:
            yield
        finally:
            self._watched = None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            watched, limit = self._watched, self.current
            if watched is not None and time.monotonic() - watched[1] > limit:
                self.on_expiry(
                    f"the {watched[0]} failed: a peer rank died, its node went away or it stalled past the collective "
                    f"timeout (no answer within {limit:g} s)"
                )
                return

    def close(self) -> None:
        self._stop.set()


def node_address(peer: str | None = None) -> str:
    """This node's address on the network that reaches ``peer`` (default MASTER_ADDR): names the node in logs."""
    peer = peer or os.environ.get("MASTER_ADDR", DEFAULT_MASTER_ADDR)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))  # UDP: no packet is sent, the kernel only picks the route
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def pick_backend() -> str:
    """``ccl`` when the oneCCL bindings for PyTorch import (they register the backend), else ``gloo``."""
    try:
        importlib.import_module("oneccl_bindings_for_pytorch")
    except ImportError:
        return "gloo"
    return "ccl"


def init_process_group(info: RankInfo, backend: str | None = None, setup_timeout_s: float | None = None) -> str | None:
    """Join the job's process group; returns the backend, or ``None`` for a single process. The set-up timeout
    defaults to the environment's (``Timeouts.from_env``)."""
    if info.world_size == 1:
        return None
    backend = backend or pick_backend()
    addr = os.environ.get("MASTER_ADDR", DEFAULT_MASTER_ADDR)
    port = int(os.environ.get("MASTER_PORT", DEFAULT_MASTER_PORT))
    timeout = datetime.timedelta(seconds=setup_timeout_s or Timeouts.from_env().setup_s)
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


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """Turn a failed collective into a DistributedError that says what it was and what it usually means."""
    try:
        yield
    except RuntimeError as exc:  # DistBackendError and gloo's errors are RuntimeErrors
        raise PeerLostError(
            f"the {what} failed: a peer rank died, its node went away or it stalled past the collective timeout ({exc})",
            peer=peer_address(str(exc)),
        ) from exc


def take_the_job_down(info: RankInfo, exit_code: int, grace_s: float = 0.0) -> None:
    """A rank that gives up under Intel MPI asks the launcher to end the whole job (PMI abort).

    Hydra only cleans up a job by itself when a rank that joined PMI dies; our ranks never join it, so a rank
    that merely exits leaves the others blocked in a collective until its timeout, and a stalled rank forever.
    With the abort, mpirun ends every rank on every node at once and exits with ``exit_code``. Open MPI's
    mpirun already ends the job when a rank exits non-zero; a single process has nothing to take down.
    ``grace_s`` lets the other survivors of a lost peer report it too before the job ends (their reports tell
    which node went away).
    """
    fd = os.environ.get("PMI_FD", "")
    if info.world_size < 2 or info.launcher != "intel-mpi" or not fd.isdigit():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(grace_s)
    try:
        with socket.socket(fileno=int(fd)) as pmi:
            pmi.settimeout(10)
            pmi.sendall(b"cmd=init pmi_version=1 pmi_subversion=1\n")
            pmi.recv(256)
            pmi.sendall(f"cmd=abort exitcode={exit_code}\n".encode())
            time.sleep(30)  # the launcher ends this process together with the others
    except OSError as exc:
        log.warning("could not ask the launcher to end the job (PMI abort: %s)", exc)


def all_reduce_sum_(buf: torch.Tensor, world_size: int) -> torch.Tensor:
    """Sum ``buf`` over all ranks in place (no-op for a single process)."""
    if world_size > 1:
        with collective("all-reduce"):
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    return buf


def all_reduce_mean_(buf: torch.Tensor, world_size: int) -> torch.Tensor:
    """Average ``buf`` over all ranks in place (no-op for a single process)."""
    return all_reduce_sum_(buf, world_size).div_(world_size) if world_size > 1 else buf


def barrier(world_size: int) -> None:
    if world_size > 1:
        with collective("barrier"):
            dist.barrier()


def all_gather_floats(values: list[float], world_size: int) -> list[list[float]]:
    """Every rank's ``values`` (the same length on each), on every rank: one small all-gather."""
    mine = torch.tensor(values, dtype=torch.float64)
    if world_size == 1:
        return [mine.tolist()]
    out = [torch.empty_like(mine) for _ in range(world_size)]
    with collective("all-gather of the rank statistics"):
        dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def all_gather_strings(text: str, world_size: int) -> list[str]:
    """Every rank's ``text``, on every rank (once per job: the node names)."""
    if world_size == 1:
        return [text]
    out: list = [None] * world_size
    with collective("all-gather of the node names"):
        dist.all_gather_object(out, text)
    return [str(x) for x in out]
