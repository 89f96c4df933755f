"""How ``xeonsd bench generate`` builds, exports and times each pipeline.

The random-weight model and concept it runs on (FLUX.1 and SD3 have no concept: the plain model, see
:mod:`xeonsd.bench.generate_flow`), the OpenVINO exports (cached in ``--workdir`` and reused while
source, shape, weight format and calibration are the same), and the timing of one variant: load (+ compile), an
optional one-step warm-up call, then the mean seconds per image over ``--images`` calls of one image. The variants
run interleaved (``Bench.measure_rounds``): in each of ``--rounds`` rounds every variant is loaded, warmed up, timed
and closed, in the order a b c … (so only one pipeline is in memory at a time, and load time is never timed), with
the process's peak resident memory read while it loads and runs (:class:`xeonsd.bench.peak_rss.PeakRss`). An
export ``xeonsd export`` refuses for this model (hybrid int8 or ToMe on a flow model) is not a crash: its variant is
recorded as skipped, with the export's own message (:class:`Refused`).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from xeonsd.bench import rounds as rnd
from xeonsd.bench.generate_flow import PLAIN_PROMPT, flow_family, torch_call_kwargs
from xeonsd.bench.peak_rss import PeakRss

log = logging.getLogger(__name__)

PROMPT = "a yellow <dicoo> robot at the beach, high quality"
TOKEN = "<dicoo>"


class Refused(Exception):
    """``xeonsd export`` refuses this export for this model (its check of the inputs, before anything loads)."""


def prompt_for(embeds: Path | None) -> str:
    """The recipe's prompt with the concept's token, or without it where the model has no concept (FLUX.1, SD3)."""
    return PROMPT if embeds is not None else PLAIN_PROMPT


@dataclass
class Result:
    key: str
    name: str
    load_s: float | None = None
    per_image_s: float | None = None  # the median of the rounds
    note: str = ""
    rounds_s: list[float] = field(default_factory=list)  # seconds per image, round by round
    per_image_spread: dict | None = None  # rnd.spread of rounds_s
    vs_a_rounds: list[float] = field(default_factory=list)  # (a) / this variant, within each round
    vs_a: dict | None = None  # rnd.spread of vs_a_rounds
    peak_rss_gb: float | None = None  # the process's peak VmRSS while the variant loaded and ran: median of rounds
    peak_rss_rounds_gb: list[float] = field(default_factory=list)


@dataclass
class Bench:
    """One run's model, concept (None: none, FLUX.1 and SD3) and work directory, the variants measured so far and
    the exports they used."""

    args: argparse.Namespace
    model: Path
    embeds: Path | None
    workdir: Path
    results: list[Result] = field(default_factory=list)
    exports: dict[str, float] = field(default_factory=dict)  # export name -> seconds it took (when it was made)
    planned: dict[str, tuple[str, Callable[[], tuple[float, float]]]] = field(default_factory=dict)
    pixels: dict[str, dict] = field(default_factory=dict)  # variant -> its image's difference to (d)'s

    def export_or_skip(
        self, key: str, name: str, kind: str, shape: Any, fmt: str, quantize: Any = None, tome: float = 0.0
    ) -> Path | None:
        """The export variant ``key`` runs on (cached in the work directory as ``ov-<kind>-<weights>``); None, with
        ``key`` recorded as skipped and the export's reason printed, where ``xeonsd export`` refuses it for this
        model."""
        export = f"{kind}-{quantize.method if quantize else fmt}" + (f"-tome{tome:g}" if tome else "")
        try:
            path, self.exports[export] = export_cached(
                self.model, self.embeds, self.workdir / f"ov-{export}", shape, fmt, quantize, tome
            )
        except Refused as exc:
            note = f"skipped: {exc}"
            print(f"({key}) {name}: {note}", flush=True)
            self.results.append(Result(key, name, note=note))
            return None
        return path

    def measure(self, key: str, name: str, fn: Callable[[], tuple[float, float]]) -> None:
        """Plan variant ``key`` (when ``--only`` asks for it): ``fn`` gives load seconds and seconds per image;
        ``measure_rounds`` runs it."""
        if key in self.args.only:
            self.planned[key] = (name, fn)

    def measure_rounds(self, rounds: int) -> None:
        """Every planned variant once per round (a b c a b c …) into ``results``, in key order: the medians of the
        rounds, their spread, and each round's speed-up over that round's (a)."""
        timings: dict[str, list[tuple[float, float]]] = {key: [] for key in self.planned}
        peaks: dict[str, list[int]] = {key: [] for key in self.planned}
        for r, key in rnd.schedule(list(self.planned), rounds):
            name, fn = self.planned[key]
            log.info("round %d of %d: (%s) %s ...", r + 1, rounds, key, name)
            with PeakRss() as peak:
                timings[key].append(fn())
            if peak.bytes is not None:
                peaks[key].append(peak.bytes)
            log.info("(%s) %s: %.2f s per image", key, name, timings[key][-1][1])
        secs = {key: [per_image for _, per_image in t] for key, t in timings.items()}
        stats = rnd.summarize(secs, baseline="a", invert=True) if "a" in secs else {}
        for key, (name, _) in self.planned.items():
            spread = rnd.spread(secs[key])
            load_s = statistics.median(load for load, _ in timings[key])
            result = Result(key, name, round(load_s, 2), round(spread["median"], 3), "", secs[key], spread)
            if key in stats:
                result.vs_a_rounds, result.vs_a = stats[key]["ratio_rounds"], stats[key]["ratio"]
            if peaks[key]:
                result.peak_rss_rounds_gb = [round(b / 1e9, 2) for b in peaks[key]]
                result.peak_rss_gb = round(statistics.median(peaks[key]) / 1e9, 2)
            self.results.append(result)
        self.results.sort(key=lambda res: res.key)


def model_dir(args: argparse.Namespace, workdir: Path) -> Path:
    """``--model``, or where the random-weight ``--arch`` model is kept in WORKDIR (``--depth`` in its name)."""
    if args.model:
        return Path(args.model)
    from xeonsd.assets.models import model_name

    return workdir / f"model-{model_name(args.arch, getattr(args, 'depth', None))}"


def model_and_concept(args: argparse.Namespace, workdir: Path) -> tuple[Path, Path | None]:
    """``--model`` (or a random-weight ``--arch`` model built once in WORKDIR) and a random concept for it (None for
    FLUX.1 and SD3, which take none)."""
    import torch

    from xeonsd.assets import make_tiny_model
    from xeonsd.modelfiles.concept_file import write_concept_file

    model = model_dir(args, workdir)
    if not model.is_dir():
        make_tiny_model(model, arch=args.arch, depth=getattr(args, "depth", None))
    if flow_family(model) is not None:
        return model, None
    # one vector set per text encoder (SDXL's two: clip_l, clip_g)
    encoders = [model / e for e in ("text_encoder", "text_encoder_2") if (model / e).is_dir()]
    hidden = [json.loads((e / "config.json").read_text())["hidden_size"] for e in encoders]
    embeds = workdir / f"concept-{'-'.join(map(str, hidden))}.safetensors"
    if not embeds.is_file():
        gen = torch.Generator().manual_seed(0)
        write_concept_file(embeds, TOKEN, [torch.randn(1, n, generator=gen) * 0.02 for n in hidden])
    return model, embeds


def torch_pipeline(model: Path, embeds: Path | None) -> Any:
    """The diffusers pipeline of ``model``'s family with the concept loaded (SDXL: into both text encoders; None:
    the plain model)."""
    import torch
    from safetensors.torch import load_file

    from xeonsd.families import detect_family
    from xeonsd.openvino.pipelines import load_torch_pipeline

    family = detect_family(model).spec
    # fp32 throughout: transformers loads a text encoder in the dtype it was saved in, and the full-size flux and
    # sd35m archs are written in bf16 (diffusers loads their transformer and VAE in fp32 either way)
    pipe = load_torch_pipeline(str(model), family)
    for part in pipe.components.values():
        if isinstance(part, torch.nn.Module) and any(p.dtype != torch.float32 for p in part.parameters()):
            part.to(dtype=torch.float32)
    if embeds is None:
        return pipe
    if family.concept_layout == "xl":
        state = load_file(str(embeds))
        pipe.load_textual_inversion(
            state["clip_l"], token=TOKEN, text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer
        )
        pipe.load_textual_inversion(
            state["clip_g"], token=TOKEN, text_encoder=pipe.text_encoder_2, tokenizer=pipe.tokenizer_2
        )
    else:
        pipe.load_textual_inversion(str(embeds))
    return pipe


def export_cached(
    model: Path,
    embeds: Path | None,
    out: Path,
    static: Any,
    weight_format: str,
    quantize: Any = None,
    tome: float = 0.0,
) -> tuple[Path, float]:
    """The export in OUT, made now unless OUT already holds one of the same source, shape, weights and ToMe ratio;
    :class:`Refused` where ``xeonsd export`` refuses it for this model."""
    from xeonsd.openvino.export import ExportOptions, export
    from xeonsd.openvino.export_inputs import ExportError, check_inputs
    from xeonsd.openvino.manifest import ExportDirError, read_manifest

    try:
        manifest = read_manifest(out)
        same_shape = manifest["static_shape"] == (None if static is None else asdict(static))
        q = manifest.get("quantization")
        made_q = None if q is None else (q["method"], q["calibration"]["samples"])
        same_q = made_q == (None if quantize is None else (quantize.method, quantize.samples))
        same_tome = (manifest.get("tome") or {}).get("ratio", 0.0) == tome
        same = same_shape and same_q and same_tome and manifest["weight_format"] == weight_format
        if manifest["source"] == str(model) and same:
            return out, float(manifest["export_seconds"])
    except ExportDirError:
        pass
    opts = ExportOptions(
        static=static, weight_format=weight_format, embeds=embeds, overwrite=True, quantize=quantize, tome=tome
    )
    try:  # the export's own checks, before anything loads: what it refuses is skipped, not a crash
        check_inputs(str(model), out, opts)
    except ExportError as exc:
        raise Refused(str(exc)) from None
    export(str(model), out, opts)
    return out, float(read_manifest(out)["export_seconds"])


def time_torch(model: Path, embeds: Path | None, args: argparse.Namespace, bf16: bool) -> tuple[float, float]:
    """diffusers on PyTorch, fp32 or under bf16 autocast: load seconds and mean seconds per image."""
    import contextlib

    import torch

    t0 = time.perf_counter()
    pipe = torch_pipeline(model, embeds)
    pipe.set_progress_bar_config(disable=True)
    load_s = time.perf_counter() - t0
    flow = flow_family(model)
    extra = {} if flow is None else torch_call_kwargs(model, flow.spec)

    def call(seed: int, steps: int) -> None:
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with ctx, torch.inference_mode():
            pipe(
                prompt_for(embeds),
                num_inference_steps=steps,
                height=args.height,
                width=args.width,
                generator=torch.Generator().manual_seed(seed),
                **extra,
            )

    if args.warmup:
        call(args.seed, 1)
    times = []
    for i in range(args.images):
        t0 = time.perf_counter()
        call(args.seed + i, args.steps)
        times.append(time.perf_counter() - t0)
    return load_s, sum(times) / len(times)


def time_torch_engine(
    model: Path, embeds: Path | None, args: argparse.Namespace, keep: list | None = None
) -> tuple[float, float]:
    """(j): the PyTorch engine of ``xeonsd generate`` and ``xeonsd serve`` (``--engine torch``: the family's diffusers
    pipeline with the concept added, bf16 where the CPU has native bf16, else fp32) on the model directory, timed as
    the OpenVINO engines are (:func:`time_ov`)."""
    from xeonsd.openvino.generate import open_engine

    prompt = prompt_for(embeds)
    opts = _options(args, prompt, height=args.height, width=args.width, batch_size=1, engine="torch", embeds=embeds)
    return _time_engine(open_engine(model, opts), prompt, args, keep)


def time_ov(ov_dir: Path, engine: str, args: argparse.Namespace, keep: list | None = None) -> tuple[float, float]:
    """Load+compile and mean seconds per image; ``keep`` gets the first timed image (seed ``args.seed``)."""
    from xeonsd.openvino.generate import open_engine
    from xeonsd.openvino.manifest import read_manifest

    manifest = read_manifest(ov_dir, verify=False)
    prompt = prompt_for(None if manifest.get("embeds") is None else Path(manifest["embeds"]))
    static = manifest["static_shape"] is not None
    size = {} if static else {"height": args.height, "width": args.width, "batch_size": 1}
    return _time_engine(open_engine(ov_dir, _options(args, prompt, engine=engine, **size)), prompt, args, keep)


def _options(args: argparse.Namespace, prompt: str, **kw: Any) -> Any:
    """The bench's request to an engine: ``prompt``, ``--images`` calls of one image, ``--steps``, ``--seed``; ``kw``:
    the engine, the shape where the model has none of its own, the concept."""
    from xeonsd.openvino.generate import GenerateOptions

    return GenerateOptions(prompts=(prompt,), num_images=args.images, steps=args.steps, seed=args.seed, **kw)


def _time_engine(eng: Any, prompt: str, args: argparse.Namespace, keep: list | None) -> tuple[float, float]:
    """An open engine's load (+ compile) seconds and mean seconds per image over its planned calls (one warm-up call
    of one step first, unless ``--no-warmup``); ``keep`` gets the first image. The engine is closed after."""
    from xeonsd.openvino.generate import Call

    try:
        if hasattr(eng._pipe, "set_progress_bar_config"):
            eng._pipe.set_progress_bar_config(disable=True)
        if args.warmup:
            eng.run(Call(prompts=[prompt], per_prompt=1, seed=args.seed), steps=1)
        times = []
        for call in eng.plan.calls:
            t0 = time.perf_counter()
            images = eng.run(call)
            times.append(time.perf_counter() - t0)
            if keep is not None and not keep:
                keep.append(images[0])
        return eng.load_s + eng.compile_s, sum(times) / len(times)
    finally:
        eng.close()
        gc.collect()
