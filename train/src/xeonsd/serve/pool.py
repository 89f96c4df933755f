"""The worker pool every engine serves through: a bounded queue in front of the workers, Busy, cancellation.

:class:`WorkerPool` is the engine interface: an engine's pool (:class:`xeonsd.serve.genai_pool.PipelinePool`, the
OpenVINO GenAI workers; :class:`xeonsd.serve.torch_pool.TorchPool`, the family's diffusers pipeline) makes its
workers (:meth:`WorkerPool.start_workers`, in the loading thread) and the images of one request on one worker
(:meth:`WorkerPool.generate`, in a worker thread); everything else here is shared, so the app and the server never
ask which engine runs:

* A request waits for a free worker in a queue of ``--queue`` places; with every worker busy and the queue full
  the answer is :class:`Busy` (429 with ``Retry-After``).
* Each request's :class:`Job` holds a flag that the deadline (``--timeout``), the client going away and a shutdown
  set; the engine's step callback reads it (:meth:`Job.should_stop`) after each denoising step and stops the
  generation there, so a cancelled request frees its worker within one step.
* A request of ``n`` images runs its calls with seeds ``rng_seed + k`` (as ``xeonsd generate`` seeds its calls;
  modulo 2**32, GenAI's seed range), and returns the first ``n`` images.
"""

from __future__ import annotations

import abc
import asyncio
import base64
import contextlib
import io
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from xeonsd.serve.metrics import Metrics
from xeonsd.serve.requests import ImageRequest

if TYPE_CHECKING:
    from xeonsd.serve.options import ServedModel

log = logging.getLogger(__name__)
SEEDS = 2**32  # GenAI's TorchGenerator takes an unsigned 32-bit seed; call k's seed + k wraps around


class NotReady(RuntimeError):
    """The pipelines are still loading (or failed to)."""


class Busy(RuntimeError):
    """Every worker is busy and the queue is full."""

    def __init__(self, retry_after: int):
        super().__init__(f"every worker is busy and the queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class Cancelled(RuntimeError):
    """The request was stopped: ``reason`` is timeout, disconnect or shutdown."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(eq=False)  # one job is one request: hashed by identity
class Job:
    request: ImageRequest
    deadline: float  # time.monotonic() past which the job is cancelled
    timeout: float
    _flag: threading.Event = field(default_factory=threading.Event)
    _woken: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str | None = None
    steps_done: int = 0

    def cancel(self, reason: str) -> None:
        """Stop the job at its next step (call on the event loop)."""
        if self.reason is None:
            self.reason = reason
        self._flag.set()
        self._woken.set()

    def should_stop(self) -> bool:
        if not self._flag.is_set() and time.monotonic() > self.deadline:
            self.reason = self.reason or "timeout"
            self._flag.set()
        return self._flag.is_set()

    def error(self) -> Cancelled:
        reason = self.reason or "timeout"
        messages = {
            "timeout": f"the request took longer than the server's --timeout of {self.timeout:g} s and was cancelled",
            "disconnect": "the client went away; the request was cancelled",
            "shutdown": "the server is shutting down; the request was cancelled",
        }
        return Cancelled(reason, messages.get(reason, reason))


class WorkerPool(abc.ABC):
    """``workers`` workers of one engine behind a queue of ``queue`` places; ``threads``: each worker's cores."""

    def __init__(
        self, served: ServedModel, workers: int, threads: int, queue: int, metrics: Metrics, precision: str = "auto"
    ):
        self.served = served
        self.precision = precision  # --precision
        self.workers = workers
        self.threads = threads
        self.queue = queue
        self.metrics = metrics
        self.compile_s: float | None = None  # seconds to load (and compile) every worker
        self.failure: BaseException | None = None
        self._free: asyncio.Queue[Any] | None = None
        self._waiting = 0
        self._jobs: set[Job] = set()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="xeonsd-worker")
        self._mean_s = 0.0  # running mean of a job's seconds on a worker (for Retry-After)
        self._done = 0
        self._ready = False
        self._draining = False

    # -- what an engine does --------------------------------------------------------------------------------------
    @abc.abstractmethod
    def start_workers(self) -> list[Any]:
        """Load (and compile) every worker, in the loading thread; raise on failure."""

    @abc.abstractmethod
    def generate(self, worker: Any, job: Job) -> list[str]:
        """In a worker thread: the request's images as base64 PNGs, stopped at the next step once the job is
        cancelled (then: count it in ``metrics.cancelled`` and raise ``job.error()``)."""

    # -- state ----------------------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Every worker loaded, and the server not stopping (a draining server is out of a balancer's rotation)."""
        return self._ready and not self._draining

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def idle(self) -> bool:
        """No request running or waiting for a worker."""
        return not self._jobs and self._waiting == 0

    def load(self, loop: asyncio.AbstractEventLoop, on_ready: Callable[[], None]) -> None:
        """Start every worker (in the calling thread), then hand them to ``loop`` and call ``on_ready`` there."""
        try:
            t0 = time.perf_counter()
            workers = self.start_workers()
            self.compile_s = time.perf_counter() - t0
        except BaseException as exc:  # reported by the server, which then exits
            self.failure = exc
            loop.call_soon_threadsafe(on_ready)
            return

        def publish() -> None:
            self._free = asyncio.Queue()
            for w in workers:
                self._free.put_nowait(w)
            self._ready = True
            self.metrics.ready.set(1)
            on_ready()

        loop.call_soon_threadsafe(publish)

    # -- requests -----------------------------------------------------------------------------------------------
    def retry_after(self) -> int:
        """Seconds until a place is likely free: the queue ahead over the workers, times a job's mean time."""
        per_job = self._mean_s or 1.0
        return max(1, math.ceil(per_job * (self._waiting + 1) / self.workers))

    async def run(self, job: Job) -> list[str]:
        """The job's images as base64 PNGs; raises :class:`NotReady`, :class:`Busy` or :class:`Cancelled`."""
        if not self._ready or self._free is None:
            raise NotReady("the pipelines are still loading; see /v2/health/ready")
        if self._free.empty() and self._waiting >= self.queue:
            raise Busy(self.retry_after())
        self._jobs.add(job)
        try:
            worker = await self._acquire(job)
            try:
                self.metrics.busy.inc()
                loop = asyncio.get_running_loop()
                t0 = time.perf_counter()
                images = await loop.run_in_executor(self._executor, self.generate, worker, job)
                self._done += 1
                self._mean_s += (time.perf_counter() - t0 - self._mean_s) / self._done
                return images
            finally:
                self.metrics.busy.dec()
                self._free.put_nowait(worker)
        finally:
            self._jobs.discard(job)

    async def _acquire(self, job: Job) -> Any:
        assert self._free is not None
        self._waiting += 1
        self.metrics.queue_depth.set(self._waiting)
        getter = asyncio.ensure_future(self._free.get())
        woken = asyncio.ensure_future(job._woken.wait())
        try:
            left = job.deadline - time.monotonic()
            await asyncio.wait({getter, woken}, timeout=max(left, 0), return_when=asyncio.FIRST_COMPLETED)
            if getter.done() and not job.should_stop():
                return getter.result()
            if getter.done():
                self._free.put_nowait(getter.result())
            job.should_stop()  # marks a timeout
            self.metrics.cancelled.labels(job.reason).inc()
            raise job.error()
        finally:
            for task in (getter, woken):
                if not task.done():
                    task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await getter
            self._waiting -= 1
            self.metrics.queue_depth.set(self._waiting)

    def stopped(self, job: Job, t0: float, steps_before: int) -> None:
        """After one call of ``job``: raise its error if it was cancelled, else time its steps (for engines)."""
        if job.should_stop():
            self.metrics.cancelled.labels(job.reason).inc()
            raise job.error()
        self.metrics.step_seconds.observe((time.perf_counter() - t0) / max(1, job.steps_done - steps_before))

    # -- shutdown -----------------------------------------------------------------------------------------------
    def start_draining(self) -> None:
        """Report not ready from now on (``/v2/health/ready`` 503), and go on answering every request."""
        self._draining = True
        self.metrics.ready.set(0)

    def cancel_all(self, reason: str) -> None:
        for job in list(self._jobs):
            job.cancel(reason)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def png_b64(pixels: Any) -> str:
    """A uint8 [height, width, 3] array, or a PIL image, as a base64 PNG."""
    from PIL import Image

    image = pixels if isinstance(pixels, Image.Image) else Image.fromarray(pixels)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")
