"""The two pipelines ``xeonsd generate`` runs an export through; each is loaded, compiled, then called.

* ``optimum`` (:class:`OptimumEngine`): ``OVStableDiffusionPipeline`` (the recipe's path; needs PyTorch and
  diffusers for the scheduler and the pipeline logic, OpenVINO runs the networks).
* ``genai`` (:class:`GenaiEngine`): ``openvino_genai.Text2ImagePipeline``, OpenVINO's own C++ pipeline; without
  ``--embeds`` it needs neither PyTorch nor diffusers nor transformers. ``--embeds`` is added to a copy of the text
  encoder and tokenizers (an overlay of the export, :mod:`xeonsd.openvino.overlay`), ``--lora`` adapters are converted to the layout GenAI applies and blended in at compile
  time. Where a family has two CLIP text encoders (SDXL) the adapters' text-encoder part is added to copies of the
  text encoders' weights instead (GenAI cannot tell them apart in an adapter; see :mod:`xeonsd.openvino.pipelines`).
  The transformer families' adapters (FLUX.1, FLUX.2 [klein], Qwen-Image) are written in the names GenAI applies
  to a transformer (:func:`xeonsd.openvino.lora_files.convert_for_genai_flux`); SD3 and Z-Image have no GenAI
  adapters (refused in :mod:`xeonsd.openvino.generate`).

Which engine, for which request, is chosen in :mod:`xeonsd.openvino.generate`.
"""

from __future__ import annotations

import abc
import inspect
import logging
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xeonsd.families import FamilySpec, of_manifest
from xeonsd.openvino import pipelines

if TYPE_CHECKING:
    from xeonsd.openvino.generate import Call, GenerateOptions, Plan

log = logging.getLogger(__name__)


class GenerateError(ValueError):
    """The request cannot be served by this export."""


@dataclass
class Engine(abc.ABC):
    """A loaded, compiled pipeline; ``run`` makes the images of one call."""

    ov_dir: Path
    plan: Plan
    opts: GenerateOptions
    concept_tokens: list[str]
    source: str = "?"  # what the export was made from (the manifest's source)
    max_sequence_length: int | None = None  # FLUX.1/SD3: T5's prompt length (the manifest's)
    family: FamilySpec = field(default_factory=lambda: of_manifest({}))  # the manifest's (none: SD 1.x/2.x)
    load_s: float = 0.0
    compile_s: float = 0.0
    _pipe: Any = None
    _workdir: tempfile.TemporaryDirectory | None = field(default=None, repr=False)

    @abc.abstractmethod
    def open(self) -> Engine:
        """Load and compile; sets ``load_s`` and ``compile_s``."""

    @abc.abstractmethod
    def run(self, call: Call, steps: int | None = None) -> list[Any]:
        """The PIL images of one call (``steps`` overrides the options, e.g. for a warm-up)."""

    def _call_kwargs(self, steps: int | None) -> dict[str, Any]:
        """What a call of either pipeline is given besides the prompts, their images and the generator."""
        kwargs: dict[str, Any] = {
            "num_inference_steps": steps or self.opts.steps,
            "guidance_scale": self.opts.guidance_scale,
            "height": self.plan.shape.height,
            "width": self.plan.shape.width,
        }
        if self.max_sequence_length is not None:
            kwargs["max_sequence_length"] = self.max_sequence_length
        return kwargs

    def close(self) -> None:
        self._pipe = None
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None


class OptimumEngine(Engine):
    def open(self) -> OptimumEngine:
        t0 = time.perf_counter()
        pipe = pipelines.ov_pipeline_class(self.family).from_pretrained(
            str(self.ov_dir),
            dynamic_shapes=not self.plan.static,
            compile=False,
            ov_config=self.opts.compile_properties(),
        )
        if self.opts.embeds is not None:
            from xeonsd.modelfiles.concept_file import add_to_openvino, load_concepts

            concepts = load_concepts(self.opts.embeds, self.opts.token, self.family)
            for encoder, tokenizer in self.family.text_side:
                add_to_openvino(getattr(pipe, tokenizer), getattr(pipe, encoder).model, concepts[encoder])
            self.concept_tokens = [*self.concept_tokens, *concepts["text_encoder"].tokens]
        if (
            self.opts.negative_prompt is not None
            and "negative_prompt" not in inspect.signature(pipe.__call__).parameters
        ):
            raise GenerateError(f"--negative-prompt: {type(pipe).__name__} takes no negative prompt; drop it")
        self.load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        encoders = [getattr(pipe, encoder) for encoder, _ in self.family.text_side]
        denoiser = getattr(pipe, self.family.denoiser)
        for part in (*encoders, denoiser, pipe.vae_decoder):  # the VAE encoder is not used here
            part.compile()
        self.compile_s = time.perf_counter() - t0
        self._pipe = pipe
        return self

    def run(self, call: Call, steps: int | None = None) -> list[Any]:
        import torch

        kwargs = self._call_kwargs(steps)
        if self.opts.negative_prompt is not None:  # FLUX.2 [klein]'s pipeline takes no negative_prompt at all
            kwargs["negative_prompt"] = [self.opts.negative_prompt] * len(call.prompts)
        generator = torch.Generator("cpu").manual_seed(call.seed)
        result = self._pipe(prompt=call.prompts, num_images_per_prompt=call.per_prompt, generator=generator, **kwargs)
        return list(result.images)


@dataclass
class GenaiEngine(Engine):
    # SDXL: the adapters' text-encoder modules and alphas, added to copies of the text encoders (see the module doc)
    _text_loras: list[tuple[list[Any], float]] = field(default_factory=list, repr=False)

    def _overlay(self) -> Path:
        """A directory like OV_DIR whose text encoders (and tokenizers) also hold the ``--embeds`` concept and, on
        SDXL, the text-encoder part of the ``--lora`` adapters (:func:`xeonsd.openvino.overlay.write_overlay`)."""
        from xeonsd.modelfiles.concept_file import load_concepts
        from xeonsd.openvino.overlay import write_overlay

        if self._workdir is None:
            self._workdir = tempfile.TemporaryDirectory(prefix="xeonsd-genai-")
        concepts = None
        if self.opts.embeds is not None:
            concepts = load_concepts(self.opts.embeds, self.opts.token, self.family)
            self.concept_tokens = [*self.concept_tokens, *concepts["text_encoder"].tokens]
        return write_overlay(self.ov_dir, Path(self._workdir.name) / "models", self.family, concepts, self._text_loras)

    def _adapters(self) -> Any:
        """The ``--lora`` adapters, checked against the export and converted to the layout GenAI applies."""
        import openvino_genai

        from xeonsd.openvino import lora_files as loraformat

        if self._workdir is None:
            self._workdir = tempfile.TemporaryDirectory(prefix="xeonsd-genai-")
        weights = loraformat.ir_weight_shapes(self.ov_dir)
        model = f"{self.ov_dir} (exported from {self.source})"
        denoiser = loraformat.PREFIXES[self.family.denoiser]
        text_apart = len(self.family.clip_encoders) > 1  # GenAI cannot tell them apart (module doc)
        pairs = []
        for i, (path, alpha) in enumerate(self.opts.loras):
            modules = loraformat.read_adapter(path)
            loraformat.check_family(path, modules, self.family, model)
            loraformat.check_genai_limits(path, modules)
            loraformat.check_fits(path, modules, weights, model)
            log.info("LoRA %s (alpha %g): %d module(s)", path, alpha, len(modules))
            if text_apart:  # the text encoders' part goes into their weights (see the module doc)
                text = [m for m in modules.values() if not m.name.startswith(denoiser)]
                self._text_loras.append((text, float(alpha)))
                modules = {k: m for k, m in modules.items() if k.startswith(denoiser)}
                if not modules:
                    continue
            converted = Path(self._workdir.name) / "lora" / f"{i}-{Path(path).stem}.safetensors"
            loraformat.convert_for_genai_of(path, modules, converted, self.family.denoiser)
            pairs.append((openvino_genai.Adapter(str(converted)), float(alpha)))
        return openvino_genai.AdapterConfig(pairs) if pairs else None

    def open(self) -> GenaiEngine:
        import openvino_genai

        t0 = time.perf_counter()
        adapters = self._adapters() if self.opts.loras else None
        overlay = self.opts.embeds is not None or any(mods for mods, _ in self._text_loras)
        models = self._overlay() if overlay else self.ov_dir
        pipe = genai_pipeline(openvino_genai.Text2ImagePipeline, models, self.max_sequence_length)
        if self.plan.static:
            shape = self.plan.shape
            pipe.reshape(shape.images_per_call, shape.height, shape.width, self.opts.guidance_scale)
        self.load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        compile_genai(pipe, self.opts.compile_properties(), adapters)
        self.compile_s = time.perf_counter() - t0
        self._pipe = pipe
        return self

    def run(self, call: Call, steps: int | None = None) -> list[Any]:
        import openvino_genai
        from PIL import Image

        from xeonsd.modelfiles.concept_file import expand_prompt

        kwargs = self._call_kwargs(steps)
        if self.opts.negative_prompt is not None:
            kwargs["negative_prompt"] = self.opts.negative_prompt
        tensor = self._pipe.generate(
            expand_prompt(call.prompts[0], self.concept_tokens),
            num_images_per_prompt=len(call.prompts) * call.per_prompt,
            generator=openvino_genai.TorchGenerator(call.seed),
            **kwargs,
        )
        return [Image.fromarray(a) for a in tensor.data]


def genai_pipeline(cls: Any, models: Path, max_sequence_length: int | None) -> Any:
    """A GenAI pipeline of class ``cls`` over the exported ``models``, given T5's prompt length (FLUX.1/SD3; None:
    CLIP only) before any reshape: GenAI fixes T5's length to its config's then."""
    pipe = cls(str(models))
    if max_sequence_length is not None:
        config = pipe.get_generation_config()
        config.max_sequence_length = max_sequence_length
        pipe.set_generation_config(config)
    return pipe


def compile_genai(pipe: Any, properties: dict[str, Any], adapters: Any = None) -> None:
    """Compile ``pipe`` on the CPU with ``properties`` and the ``AdapterConfig`` ``adapters`` (None: none); GenAI
    applies adapters only when they are given at compile time, and never switches them afterwards."""
    if adapters is not None:
        pipe.compile("CPU", adapters=adapters, **properties)
    else:
        pipe.compile("CPU", **properties)
