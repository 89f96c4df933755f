""":class:`TorchEngine`: a family's diffusers pipeline in PyTorch, with a run's LoRA or concept, one call at a time.

What a call is given besides the prompts (:func:`call_extras`) follows the trainer's validation images
(:func:`xeonsd.trainer.pipelines.render_validation`), so that a run's images are made as it trained:

* the guidance: ``guidance_scale`` where the denoiser embeds it (FLUX.1 [dev], Kontext) or the pipeline has no
  true CFG, else ``true_cfg_scale`` (Qwen-Image-Edit: the family's 4.0, which acts only with a negative prompt);
* the size: ``height``/``width`` where the pipeline takes them (an image-to-image pipeline may take the image's),
  and ``max_area`` (their product) where the pipeline rescales to an area of its own (Kontext's ~1 MP);
* the reference images (``--image``) of an edit model: FLUX.1 Kontext's is resized to the image's area at its own
  aspect (``_auto_resize`` off: the pipeline would pick a ~1 MP size), as the trainer made the references' latents at
  the training image's size; Qwen-Image-Edit's go whole to the pipeline, which resizes them itself, inside the
  family's ``rendering`` context (the reference's latents at the image's area, not 1024x1024).
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xeonsd.openvino.engines import Engine, GenerateError

if TYPE_CHECKING:
    from xeonsd.openvino.generate import Call

log = logging.getLogger(__name__)


def torch_dtype(precision: str = "auto") -> Any:
    """The dtype the pipeline runs in: bf16 where the CPU multiplies bf16 natively (AMX or AVX512-BF16; what the
    trainer's ``--mixed_precision auto`` chooses), fp32 elsewhere and for ``--precision f32``."""
    import torch

    from xeonsd.cpu import cpu_info

    if precision == "auto" and cpu_info().native_bf16 is not None:
        return torch.bfloat16
    return torch.float32


def load_pipeline(src: str | Path, family: Any, dtype: Any) -> Any:
    """``family``'s diffusers pipeline at ``src`` in ``dtype``, with its processor where it has one (Qwen-Image-Edit's
    torchvision-free :class:`~xeonsd.families.qwenimage_edit.processor.VisionProcessor`)."""
    import diffusers

    kwargs = dict(family.pipeline_kwargs)
    if family.processor:
        kwargs[family.processor] = family.training.load_processor(str(src), family.processor, None)
    pipe = getattr(diffusers, family.pipeline_class).from_pretrained(str(src), torch_dtype=dtype, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def add_concepts(pipe: Any, family: Any, concepts: dict[str, Any]) -> list[str]:
    """A textual-inversion concept (per text encoder, :func:`~xeonsd.modelfiles.concept_file.load_concepts`) added
    to the pipeline's tokenizer(s) and text encoder(s); returns its tokens."""
    from xeonsd.modelfiles.concept_file import add_to_torch

    for encoder, tokenizer in family.text_side:
        add_to_torch(getattr(pipe, tokenizer), getattr(pipe, encoder), concepts[encoder])
    return list(concepts["text_encoder"].tokens)


def fit_area(image: Any, area: int, multiple: int) -> Any:
    """``image`` resized to about ``area`` pixels at its aspect, each side a multiple of ``multiple``."""
    w, h = image.size
    width = max(multiple, round(math.sqrt(area * w / h) / multiple) * multiple)
    height = max(multiple, round(math.sqrt(area * h / w) / multiple) * multiple)
    return image.resize((width, height)) if (width, height) != (w, h) else image


def call_extras(
    pipe: Any, family: Any, height: int, width: int, guidance_scale: float | None, references: list[Any]
) -> dict[str, Any]:
    """The keyword arguments of a call besides the prompts, generator and steps (see the module's docstring)."""
    takes = inspect.signature(pipe.__call__).parameters
    # the size, where the pipeline takes one (SD's and SDXL's image-to-image: the image's)
    out: dict[str, Any] = {k: v for k, v in (("height", height), ("width", width)) if k in takes}
    embedded = bool(getattr(getattr(pipe, family.denoiser).config, "guidance_embeds", False))
    if guidance_scale is not None:
        key = "true_cfg_scale" if "true_cfg_scale" in takes and not embedded else "guidance_scale"
        out[key] = guidance_scale
    if "max_area" in takes:
        out["max_area"] = height * width
    if references:
        images = list(references)
        if "_auto_resize" in takes:
            out["_auto_resize"] = False
            multiple = getattr(pipe, "vae_scale_factor", 8) * 2
            images = [fit_area(im, height * width, multiple) for im in images]
        out["image"] = images[0] if len(images) == 1 else images
    return out


@dataclass
class TorchEngine(Engine):
    """The family's diffusers pipeline over ``ov_dir``, here a pipeline directory: the base model (a LoRA or concept
    added at load) or a full fine-tune's output. ``compile_s`` stays 0: nothing is compiled."""

    dtype: Any = None
    _references: list[Any] = field(default_factory=list, repr=False)

    def open(self) -> TorchEngine:
        from PIL import Image

        for path in self.opts.references:
            with Image.open(path) as im:
                self._references.append(im.convert("RGB"))
        self.dtype = torch_dtype(self.opts.precision)
        t0 = time.perf_counter()
        pipe = load_pipeline(self.ov_dir, self.family, self.dtype)
        if self.opts.embeds is not None:
            from xeonsd.modelfiles.concept_file import load_concepts

            concepts = load_concepts(self.opts.embeds, self.opts.token, self.family)
            self.concept_tokens = [*self.concept_tokens, *add_concepts(pipe, self.family, concepts)]
        if self.opts.loras:
            self._add_adapters(pipe)
        if (
            self.opts.negative_prompt is not None
            and "negative_prompt" not in inspect.signature(pipe.__call__).parameters
        ):
            raise GenerateError(f"--negative-prompt: {type(pipe).__name__} takes no negative prompt; drop it")
        self.load_s = time.perf_counter() - t0
        self._pipe = pipe
        log.info("%s loaded from %s in %s (%.1f s)", type(pipe).__name__, self.ov_dir, self.dtype, self.load_s)
        return self

    def _add_adapters(self, pipe: Any) -> None:
        """Each ``--lora``: a LoRA or DoRA file loaded by diffusers as a named adapter, at its alpha; a LoKr or LoHa run
        (peft's layout, which diffusers does not read) merged into the denoiser at its alpha."""
        from xeonsd.openvino.adapter_fusion import adapter_kind, fuse_peft

        names, alphas = [], []
        for path, alpha in self.opts.loras:
            adapter = adapter_kind(Path(path))
            if adapter.peft:
                fuse_peft(pipe, self.family, adapter.path, float(alpha), str(self.ov_dir))
                log.info("%s adapter %s merged at %g", adapter.kind, path, float(alpha))
                continue
            names.append(f"lora{len(names)}")
            pipe.load_lora_weights(str(Path(path).parent), weight_name=Path(path).name, adapter_name=names[-1])
            alphas.append(float(alpha))
            log.info("%s %s loaded as %s", adapter.kind, path, names[-1])
        if names:
            pipe.set_adapters(names, alphas)

    def run(self, call: Call, steps: int | None = None) -> list[Any]:
        import torch

        shape = self.plan.shape
        kwargs = call_extras(
            self._pipe, self.family, shape.height, shape.width, self.opts.guidance_scale, self._references
        )
        kwargs["num_inference_steps"] = steps or self.opts.steps
        if self.max_sequence_length is not None:
            kwargs["max_sequence_length"] = self.max_sequence_length
        generator = torch.Generator("cpu").manual_seed(call.seed)
        # An edit pipeline reads one set of references per call (Qwen-Image-Edit's prompt template holds them): a
        # call of several prompts runs them one after the other, on the one generator.
        batches = [[p] for p in call.prompts] if self._references else [list(call.prompts)]
        rendering = self.family.training.rendering(round(math.sqrt(shape.height * shape.width)))
        images: list[Any] = []
        with torch.inference_mode(), rendering:
            for prompts in batches:
                if self.opts.negative_prompt is not None:
                    kwargs["negative_prompt"] = [self.opts.negative_prompt] * len(prompts)
                result = self._pipe(
                    prompt=prompts, num_images_per_prompt=call.per_prompt, generator=generator, **kwargs
                )
                images.extend(result.images)
        return images
