"""The OpenVINO GenAI engine's pool: ``--workers`` GenAI ``Text2ImagePipeline`` copies (the queue, ``Busy`` and
cancellation are the shared :class:`xeonsd.serve.pool.WorkerPool`'s).

* Each worker holds, for the base model, each registered adapter (at its ``--adapter`` alpha) and each ``--blend``,
  pipelines compiled with exactly that adapter set (``INFERENCE_NUM_THREADS`` = the worker's share of the cores),
  and each call is given that compile-time ``AdapterConfig``: GenAI never switches adapters on a pipeline, as
  switching is broken in openvino-genai 2026.4.1 (every ``AdapterConfig.Mode``; base, A, base, A gives the base or
  a gray image the second time: docs/serving.md, "LoRA blends"). The cost: a compile and a copy of the models per
  adapter set and worker. A request runs on its adapter set's pipelines (``contracts.blend_syntax.blend_key``, the keys).
* GenAI calls a step callback after each denoising step; returning True stops the generation there: the callback
  returns the request's :meth:`~xeonsd.serve.pool.Job.should_stop`.
* A request of ``n`` images runs ``ceil(n / images per call)`` calls of the static batch, call k with seed
  ``rng_seed + k``.
* Edits (``FamilySpec.genai_edits``): GenAI 2026.4.1 reshapes the VAE encoder to the images per call but encodes one
  image ("Batch size must be 1"), so the edit pipelines are compiled for one image per call (an edit of ``n``
  images is ``n`` calls, seeds ``rng_seed + k``). A pipeline made from a compiled one shares its models; measured
  on the tiny exports, that works from an ``InpaintingPipeline`` of the UNet families (SD, SDXL) only (FLUX.1 loses
  its T5 length, SD3 crashes), so: UNet family with inpainting, one compile for both edits, and with one image per
  call the text-to-image pipeline comes from it too (one compile per worker); otherwise each edit pipeline is a
  compile of its own. FLUX.1's image-to-image needs the height and width given, so every edit call gives them.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from xeonsd.contracts.blend_syntax import Chosen
from xeonsd.openvino.engines import compile_genai, genai_pipeline
from xeonsd.openvino.generate_args import PRECISIONS
from xeonsd.serve.options import compiled_pipelines
from xeonsd.serve.pool import SEEDS, Job, WorkerPool, png_b64
from xeonsd.serve.requests import ImageRequest

log = logging.getLogger(__name__)
WARMUP_STEPS = 1


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


class PipelinePool(WorkerPool):
    """The GenAI workers, each ``threads`` cores (``INFERENCE_NUM_THREADS``), compiled with ``precision``'s
    properties (``PRECISIONS``)."""

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

    def start_workers(self) -> list[Worker]:
        import openvino_genai

        adapters = {n: (openvino_genai.Adapter(str(p)), a) for n, (p, a) in self.served.adapters.items()}
        workers = []
        for i in range(self.workers):
            workers.append(self._compile_one(i, adapters))
            log.info(
                "worker %d/%d compiled (%d thread(s), precision %s)", i + 1, self.workers, self.threads, self.precision
            )
        return workers

    def generate(self, worker: Worker, job: Job) -> list[str]:
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
            self.stopped(job, t0, done)
            images.extend(np.array(tensor.data))  # a copy: the next call writes into the same output tensor
        return [png_b64(a) for a in images[: req.n]]

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


def _warm_up(model: str, adapters: Chosen, kind: str, shape: Any) -> ImageRequest:
    """A one-step request of ``kind`` that no client sent (a gray image; the mask: white, all repainted)."""
    import numpy as np

    image = None if kind == "generation" else np.full((shape.height, shape.width, 3), 128, np.uint8)
    mask = None if kind != "inpainting" else np.full_like(image, 255)
    edit = {"image": image, "mask": mask, "strength": 1.0}
    return ImageRequest("warm-up", model, 1, WARMUP_STEPS, 0, 7.5, None, adapters, **edit)  # type: ignore[arg-type]
