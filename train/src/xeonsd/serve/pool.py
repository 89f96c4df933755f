"""The worker pool: ``--workers`` GenAI ``Text2ImagePipeline`` copies, a bounded queue in front, cancellation.

* Each worker is a pipeline of its own, reshaped to the export's static shape and compiled with every registered
  adapter (GenAI applies adapters only when they are given at compile time) and ``INFERENCE_NUM_THREADS`` = its
  share of the cores. The Python binding of openvino-genai 2026.4.1 has no ``Text2ImagePipeline.clone()``, so a
  copy is a second compile from the same files (memory grows with the workers; the compile runs once at start-up).
  A request picks its adapter with ``generate(adapters=...)``: an empty ``AdapterConfig`` is the base model,
  exactly, and switching needs no recompile.
* A request waits for a free worker in a queue of ``--queue`` places; with every worker busy and the queue full
  the answer is :class:`Busy` (429 with ``Retry-After``).
* GenAI calls a step callback after each denoising step; returning True stops the generation there. Each request's
  :class:`Job` holds a flag that the deadline (``--timeout``), the client going away and a shutdown set, and the
  callback returns it, so a cancelled request frees its worker within one step.
* A request of ``n`` images runs ``ceil(n / images per call)`` calls of the static batch, call k with seed
  ``rng_seed + k`` (as ``xeonsd generate`` seeds its calls; modulo 2**32, GenAI's seed range), and returns the first
  ``n`` images.
"""

from __future__ import annotations

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
from typing import Any

from xeonsd.openvino.generate_args import PRECISIONS
from xeonsd.serve.metrics import Metrics
from xeonsd.serve.options import ServedModel
from xeonsd.serve.requests import ImageRequest

log = logging.getLogger(__name__)
WARMUP_STEPS = 1
SEEDS = 2**32  # GenAI's TorchGenerator takes an unsigned 32-bit seed; call k's seed + k wraps around


class NotReady(RuntimeError):
    """The pipelines are still compiling (or failed to)."""


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


@dataclass
class Worker:
    index: int
    pipe: Any
    configs: dict[str, Any]  # model name -> the AdapterConfig a request of that model passes to generate


class PipelinePool:
    def __init__(
        self, served: ServedModel, workers: int, threads: int, queue: int, metrics: Metrics, precision: str = "auto"
    ):
        self.served = served
        self.precision = precision  # --precision: the compile properties of PRECISIONS[precision]
        self.workers = workers
        self.threads = threads  # INFERENCE_NUM_THREADS of each worker
        self.queue = queue
        self.metrics = metrics
        self.compile_s: float | None = None
        self.failure: BaseException | None = None
        self._free: asyncio.Queue[Worker] | None = None
        self._waiting = 0
        self._jobs: set[Job] = set()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="xeonsd-worker")
        self._mean_s = 0.0  # running mean of a job's seconds on a worker (for Retry-After)
        self._done = 0
        self._ready = False
        self._draining = False

    @property
    def ready(self) -> bool:
        """Every worker compiled, and the server not stopping (a draining server is out of a balancer's rotation)."""
        return self._ready and not self._draining

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def idle(self) -> bool:
        """No request running or waiting for a worker."""
        return not self._jobs and self._waiting == 0

    @property
    def waiting(self) -> int:
        return self._waiting

    # -- start-up -----------------------------------------------------------------------------------------------
    def _compile_one(self, index: int, adapters: dict[str, Any]) -> Worker:
        import openvino_genai

        shape = self.served.shape
        pipe = openvino_genai.Text2ImagePipeline(str(self.served.export_dir))
        if self.served.max_sequence_length is not None:  # before reshape, as xeonsd generate's genai engine does
            config = pipe.get_generation_config()
            config.max_sequence_length = self.served.max_sequence_length
            pipe.set_generation_config(config)
        pipe.reshape(shape.images_per_call, shape.height, shape.width, 7.5)
        props = {"INFERENCE_NUM_THREADS": self.threads, **PRECISIONS[self.precision]}
        if adapters:
            everything = openvino_genai.AdapterConfig([(a, alpha) for a, alpha in adapters.values()])
            pipe.compile("CPU", adapters=everything, **props)
        else:
            pipe.compile("CPU", **props)
        configs = {self.served.name: openvino_genai.AdapterConfig()}
        for name, (adapter, alpha) in adapters.items():
            configs[name] = openvino_genai.AdapterConfig([(adapter, alpha)])
        worker = Worker(index=index, pipe=pipe, configs=configs)
        for name in configs:  # the first call of each pipeline and adapter pays for set-up: not a client
            self._call(worker, name, "warm-up", WARMUP_STEPS, 0, 7.5, None, lambda *_: False)
        return worker

    def load(self, loop: asyncio.AbstractEventLoop, on_ready: Callable[[], None]) -> None:
        """Compile every worker (in the calling thread), then hand them to ``loop`` and call ``on_ready`` there."""
        import openvino_genai

        try:
            t0 = time.perf_counter()
            adapters = {n: (openvino_genai.Adapter(str(p)), a) for n, (p, a) in self.served.adapters.items()}
            workers = []
            for i in range(self.workers):
                workers.append(self._compile_one(i, adapters))
                log.info(
                    "worker %d/%d compiled (%d thread(s), precision %s)",
                    i + 1,
                    self.workers,
                    self.threads,
                    self.precision,
                )
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
            raise NotReady("the pipelines are still compiling; see /v2/health/ready")
        if self._free.empty() and self._waiting >= self.queue:
            raise Busy(self.retry_after())
        self._jobs.add(job)
        try:
            worker = await self._acquire(job)
            try:
                self.metrics.busy.inc()
                loop = asyncio.get_running_loop()
                t0 = time.perf_counter()
                images = await loop.run_in_executor(self._executor, self._generate, worker, job)
                self._done += 1
                self._mean_s += (time.perf_counter() - t0 - self._mean_s) / self._done
                return images
            finally:
                self.metrics.busy.dec()
                self._free.put_nowait(worker)
        finally:
            self._jobs.discard(job)

    async def _acquire(self, job: Job) -> Worker:
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

    def _generate(self, worker: Worker, job: Job) -> list[str]:
        """In a worker thread: the request's calls, stopped at the next step once the job is cancelled."""
        req = job.request
        per_call = self.served.shape.images_per_call

        def on_step(step: int, num_steps: int, latent: Any) -> bool:
            job.steps_done += 1
            return job.should_stop()

        images: list[Any] = []
        for k in range(math.ceil(req.n / per_call)):
            t0 = time.perf_counter()
            tensor = self._call(
                worker, req.model, req.prompt, req.steps, req.seed + k, req.guidance_scale, req.negative_prompt, on_step
            )
            if job.should_stop():
                self.metrics.cancelled.labels(job.reason).inc()
                raise job.error()
            self.metrics.step_seconds.observe((time.perf_counter() - t0) / req.steps)
            images.extend(tensor.data)
        return [_png_b64(a) for a in images[: req.n]]

    def _call(
        self,
        worker: Worker,
        model: str,
        prompt: str,
        steps: int,
        seed: int,
        guidance: float,
        negative: str | None,
        callback: Callable[[int, int, Any], bool],
    ) -> Any:
        import openvino_genai

        from xeonsd.modelfiles.concept_file import expand_prompt

        shape = self.served.shape
        kwargs: dict[str, Any] = {} if negative is None else {"negative_prompt": negative}
        return worker.pipe.generate(
            expand_prompt(prompt, self.served.concept_tokens),
            num_images_per_prompt=shape.images_per_call,
            num_inference_steps=steps,
            guidance_scale=guidance,
            height=shape.height,
            width=shape.width,
            generator=openvino_genai.TorchGenerator(seed % SEEDS),
            adapters=worker.configs[model],
            callback=callback,
            **kwargs,
        )

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


def _png_b64(pixels: Any) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")
