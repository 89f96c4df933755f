"""The worker pool: ``--workers`` GenAI ``Text2ImagePipeline`` copies, a bounded queue in front, cancellation.

* Each worker holds, for the base model, each registered adapter (at its ``--adapter`` alpha) and each ``--blend``,
  pipelines compiled with exactly that adapter set (``INFERENCE_NUM_THREADS`` = the worker's share of the cores),
  and each call is given that compile-time ``AdapterConfig``: GenAI never switches adapters on a pipeline, as
  switching is broken in openvino-genai 2026.4.1 (every ``AdapterConfig.Mode``; base, A, base, A gives the base or
  a gray image the second time: docs/serving.md, "LoRA blends"). The cost: a compile and a copy of the models per
  adapter set and worker. A request runs on its adapter set's pipelines (``contracts.blend_syntax.blend_key``, the keys).
* A request waits for a free worker in a queue of ``--queue`` places; with every worker busy and the queue full
  the answer is :class:`Busy` (429 with ``Retry-After``).
* GenAI calls a step callback after each denoising step; returning True stops the generation there. Each request's
  :class:`Job` holds a flag that the deadline (``--timeout``), the client going away and a shutdown set, and the
  callback returns it, so a cancelled request frees its worker within one step.
* A request of ``n`` images runs ``ceil(n / images per call)`` calls of the static batch, call k with seed
  ``rng_seed + k`` (as ``xeonsd generate`` seeds its calls; modulo 2**32, GenAI's seed range), and returns the first
  ``n`` images.
* Edits (``FamilySpec.genai_edits``): GenAI 2026.4.1 reshapes the VAE encoder to the images per call but encodes one
  image ("Batch size must be 1"), so the edit pipelines are compiled for one image per call (an edit of ``n``
  images is ``n`` calls, seeds ``rng_seed + k``). A pipeline made from a compiled one shares its models; measured
  on the tiny exports, that works from an ``InpaintingPipeline`` of the UNet families (SD, SDXL) only (FLUX.1 loses
  its T5 length, SD3 crashes), so: UNet family with inpainting, one compile for both edits, and with one image per
  call the text-to-image pipeline comes from it too (one compile per worker); otherwise each edit pipeline is a
  compile of its own. FLUX.1's image-to-image needs the height and width given, so every edit call gives them.
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

from xeonsd.contracts.blend_syntax import Chosen
from xeonsd.openvino.engines import compile_genai, genai_pipeline
from xeonsd.openvino.generate_args import PRECISIONS
from xeonsd.serve.metrics import Metrics
from xeonsd.serve.options import ServedModel, compiled_pipelines
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
class Served:
    """The pipelines of one served model on a worker, all compiled with ``config`` (None: the base model)."""

    pipe: Any
    config: Any
    edits: dict[str, Any] = field(default_factory=dict)  # image2image / inpainting -> its pipeline


@dataclass
class Worker:
    index: int
    models: dict[Chosen, Served]  # (), ((name, alpha),) of each adapter and each --blend's key -> its pipelines

    def served(self, adapters: Chosen) -> Served:
        found = self.models.get(adapters)
        if found is None:  # requests.validate lets only these through
            raise ValueError(f"no pipeline compiled for adapters {adapters!r}; compiled: {list(self.models)}")
        return found


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

    # -- start-up -----------------------------------------------------------------------------------------------
    def _prepared(self, cls: Any, images: int, config: Any) -> Any:
        """A GenAI pipeline of class ``cls`` over the export (with ``--embeds``: its overlay holding the concept),
        reshaped to ``images`` per call and compiled with the ``AdapterConfig`` ``config`` (None: no adapters)."""
        shape = self.served.shape
        pipe = genai_pipeline(cls, self.served.models_dir, self.served.max_sequence_length)
        pipe.reshape(images, shape.height, shape.width, 7.5)
        compile_genai(pipe, {"INFERENCE_NUM_THREADS": self.threads, **PRECISIONS[self.precision]}, config)
        return pipe

    def _compile_model(self, config: Any) -> Served:
        """The pipelines of one served model, compiled with ``config`` (:func:`compiled_pipelines`); the others are
        made from the inpainting pipeline and share its models (see the module's docstring)."""
        import openvino_genai as g

        classes = {
            "generation": g.Text2ImagePipeline,
            "image2image": g.Image2ImagePipeline,
            "inpainting": g.InpaintingPipeline,
        }
        per_call = self.served.shape.images_per_call
        pipes = {
            kind: self._prepared(classes[kind], per_call if kind == "generation" else 1, config)
            for kind in compiled_pipelines(self.served.family, per_call)
        }
        for kind in ("generation", *self.served.family.genai_edits):
            if kind not in pipes:
                pipes[kind] = classes[kind](pipes["inpainting"])
        return Served(pipe=pipes.pop("generation"), config=config, edits=pipes)

    def _compile_one(self, index: int, adapters: dict[str, Any]) -> Worker:
        import openvino_genai as g

        models = {(): self._compile_model(None)}
        for name, (adapter, alpha) in adapters.items():
            models[((name, alpha),)] = self._compile_model(g.AdapterConfig([(adapter, alpha)]))
        for key in self.served.blends:  # a --blend: its adapters at their weights, in one AdapterConfig
            models[key] = self._compile_model(g.AdapterConfig([(adapters[name][0], w) for name, w in key]))
        worker = Worker(index=index, models=models)
        # the first call of each pipeline pays for set-up: not a client
        for chosen, served in models.items():
            name = chosen[0][0] if chosen else self.served.name
            for kind in ("generation", *served.edits):
                self._call(worker, _warm_up(name, chosen, kind, self.served.shape), lambda *_: False, 0)
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
        import numpy as np

        req = job.request
        per_call = 1 if req.kind != "generation" else self.served.shape.images_per_call

        def on_step(step: int, num_steps: int, latent: Any) -> bool:
            job.steps_done += 1
            return job.should_stop()

        images: list[Any] = []
        for k in range(math.ceil(req.n / per_call)):
            t0, done = time.perf_counter(), job.steps_done
            tensor = self._call(worker, req, on_step, k)
            if job.should_stop():
                self.metrics.cancelled.labels(job.reason).inc()
                raise job.error()
            self.metrics.step_seconds.observe((time.perf_counter() - t0) / max(1, job.steps_done - done))
            images.extend(np.array(tensor.data))  # a copy: the next call writes into the same output tensor
        return [_png_b64(a) for a in images[: req.n]]

    def _call(self, worker: Worker, req: ImageRequest, callback: Callable[[int, int, Any], bool], k: int) -> Any:
        """Call ``k`` of ``req`` (seed ``rng_seed + k``) on the worker's pipeline of the request's kind."""
        import openvino as ov
        import openvino_genai

        from xeonsd.modelfiles.concept_file import expand_prompt

        shape = self.served.shape
        served = worker.served(req.adapters)
        kwargs: dict[str, Any] = {} if req.negative_prompt is None else {"negative_prompt": req.negative_prompt}
        if served.config is not None:  # its compile-time config: GenAI applies it once and never switches
            kwargs["adapters"] = served.config
        kwargs.update(
            num_inference_steps=req.steps,
            guidance_scale=req.guidance_scale,
            height=shape.height,
            width=shape.width,
            generator=openvino_genai.TorchGenerator((req.seed + k) % SEEDS),
            callback=callback,
        )
        prompt = expand_prompt(req.prompt, self.served.concept_tokens)
        if req.kind == "generation":
            return served.pipe.generate(prompt, num_images_per_prompt=shape.images_per_call, **kwargs)
        if req.strength is not None:
            kwargs["strength"] = req.strength
        image = ov.Tensor(req.image[None])
        if req.kind == "image2image":
            return served.edits["image2image"].generate(prompt, image, **kwargs)
        return served.edits["inpainting"].generate(prompt, image, ov.Tensor(req.mask[None]), **kwargs)

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


def _warm_up(model: str, adapters: Chosen, kind: str, shape: Any) -> ImageRequest:
    """A one-step request of ``kind`` that no client sent (a gray image; the mask: white, all repainted)."""
    import numpy as np

    image = None if kind == "generation" else np.full((shape.height, shape.width, 3), 128, np.uint8)
    mask = None if kind != "inpainting" else np.full_like(image, 255)
    edit = {"image": image, "mask": mask, "strength": 1.0}
    return ImageRequest("warm-up", model, 1, WARMUP_STEPS, 0, 7.5, None, adapters, **edit)  # type: ignore[arg-type]


def _png_b64(pixels: Any) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")
