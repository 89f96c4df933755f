"""The PyTorch engine's pool (``xeonsd serve --engine torch``): the family's diffusers pipeline over a pipeline
directory, as ``xeonsd generate --engine torch`` runs it (:mod:`xeonsd.torch_engine`: bf16 where the CPU has it,
fp32 elsewhere and for ``--precision f32``; the family's processor, call arguments and rendering context).

* One worker on every core (``torch.set_num_threads``): PyTorch's operators use all the threads they are given, so
  a second pipeline would only share them; the queue, ``Busy`` and the cancellation are the shared
  :class:`~xeonsd.serve.pool.WorkerPool`'s.
* Each ``--adapter`` is loaded once at start-up by diffusers' ``load_lora_weights`` as a named adapter; a request
  picks its adapter set with ``set_adapters`` (a ``--blend``: its adapters at its weights) or, for the base model,
  ``disable_lora``: nothing is loaded per request. ``--embeds``' concept is added to the text encoder(s) at start-up.
* Cancellation: diffusers calls ``callback_on_step_end`` after each denoising step; once the request's job is
  cancelled the callback sets the pipeline's ``_interrupt``, which skips the remaining steps.
* A request of ``n`` images is ``n`` calls of one image, call k with seed ``rng_seed + k``; an edit family's
  reference images (``image[]``) go to every call.
* Image-to-image and inpainting (a family without reference images): the family's diffusers pipelines for them
  (``FamilySpec.torch_edits``), made at start-up with ``from_pipe``, so they share the served pipeline's modules
  (its adapters and concept included); the request's ``image``, ``mask`` (white: repainted) and ``strength`` go to
  the call (the size only where the pipeline takes one: :func:`~xeonsd.torch_engine.engine.call_extras`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from xeonsd.contracts.blend_syntax import Chosen
from xeonsd.serve.pool import SEEDS, Job, WorkerPool, png_b64
from xeonsd.torch_engine.engine import add_concepts, call_extras, load_pipeline, torch_dtype

log = logging.getLogger(__name__)


@dataclass
class TorchWorker:
    pipe: Any
    names: dict[str, str] = field(default_factory=dict)  # a served adapter's name -> its name in the pipeline
    edits: dict[str, Any] = field(default_factory=dict)  # image2image / inpainting -> its pipeline (from_pipe)

    def pipeline(self, kind: str) -> Any:
        """The pipeline that runs a request of ``kind`` (:attr:`ImageRequest.kind`)."""
        return self.edits.get(kind, self.pipe)

    def select(self, chosen: Chosen) -> None:
        """Activate the request's adapters at their weights; () the base model (every adapter off)."""
        if not self.names:
            return
        if not chosen:
            self.pipe.disable_lora()
            return
        self.pipe.enable_lora()
        self.pipe.set_adapters([self.names[n] for n, _ in chosen], [float(w) for _, w in chosen])


class TorchPool(WorkerPool):
    """The family's diffusers pipeline, one request at a time on ``threads`` cores."""

    def start_workers(self) -> list[TorchWorker]:
        import torch

        torch.set_num_threads(self.threads)
        served, family = self.served, self.served.family
        dtype = torch_dtype(self.precision)
        pipe = load_pipeline(served.models_dir, family, dtype)
        if served.concepts is not None:
            add_concepts(pipe, family, served.concepts)
        names = {}
        for i, (name, (path, _alpha)) in enumerate(served.adapters.items()):
            names[name] = f"adapter{i}"  # peft makes module keys of adapter names: no '.' there
            pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=names[name])
        import diffusers

        edits = {
            kind: getattr(diffusers, cls).from_pipe(pipe) for kind, cls in family.torch_edits if kind in served.edits
        }
        for edit in edits.values():
            edit.set_progress_bar_config(disable=True)
        log.info(
            "%s loaded from %s in %s on %d thread(s), %d adapter(s), edits: %s",
            type(pipe).__name__,
            served.models_dir,
            dtype,
            self.threads,
            len(names),
            ", ".join(f"{k} ({type(p).__name__})" for k, p in edits.items()) or "none",
        )
        return [TorchWorker(pipe, names, edits)]

    def call_kwargs(self, pipe: Any, job: Job) -> dict[str, Any]:
        """What each call of the request gives the pipeline besides the prompt and the generator."""
        from PIL import Image

        req, shape = job.request, self.served.shape
        references = [Image.fromarray(a) for a in req.references]
        kwargs = call_extras(pipe, self.served.family, shape.height, shape.width, req.guidance_scale, references)
        kwargs["num_inference_steps"] = req.steps
        if req.kind in ("image2image", "inpainting"):
            kwargs.update(image=Image.fromarray(req.image), strength=req.strength)
            if req.mask is not None:
                kwargs["mask_image"] = Image.fromarray(req.mask)
        if self.served.max_sequence_length is not None:
            kwargs["max_sequence_length"] = self.served.max_sequence_length
        if req.negative_prompt is not None:
            kwargs["negative_prompt"] = [req.negative_prompt]

        def on_step(pipeline: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            job.steps_done += 1
            if job.should_stop():
                pipeline._interrupt = True  # diffusers skips the remaining steps
            return {}

        kwargs["callback_on_step_end"] = on_step
        return kwargs

    def generate(self, worker: TorchWorker, job: Job) -> list[str]:
        import torch

        req, shape, family = job.request, self.served.shape, self.served.family
        worker.select(req.adapters)
        pipe = worker.pipeline(req.kind)
        kwargs = self.call_kwargs(pipe, job)
        images = []
        for k in range(req.n):
            t0, done = time.perf_counter(), job.steps_done
            generator = torch.Generator("cpu").manual_seed((req.seed + k) % SEEDS)
            rendering = family.training.rendering(round(math.sqrt(shape.height * shape.width)))
            with torch.inference_mode(), rendering:
                result = pipe(prompt=[req.prompt], num_images_per_prompt=1, generator=generator, **kwargs)
            self.stopped(job, t0, done)
            images.append(png_b64(result.images[0]))
        return images
