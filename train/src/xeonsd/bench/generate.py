"""``xeonsd bench generate``: one prompt, seed and step count through ten pipelines, measured in one run.

(a) diffusers PyTorch fp32, (b) PyTorch bf16 autocast, (c) OpenVINO dynamic shapes, (d) OpenVINO static shapes,
(e) OpenVINO static with int8 weights, (f) OpenVINO GenAI on the static export, (g) OpenVINO static hybrid int8
(``export --quantize hybrid``, calibrated on the recipe's prompt and templates), printed beside (d) with the speed
ratio and the mean absolute pixel difference to (d)'s image of the same seed; its target (>= 1.4x faster than (d))
is judged only on a CPU with AMX-INT8. (h) OpenVINO static with token merging (``export --tome``, ``--tome`` ratio,
0.5 by default) and (i) token merging + hybrid int8, each beside (d) in the same way; the target of (i) (>= 1.8x
faster than (d) at 512 px) is judged only on AMX. (j) the PyTorch engine of ``xeonsd generate`` and ``xeonsd serve``
(``--engine torch``: the family's diffusers pipeline, bf16 where the CPU has native bf16, else fp32; the only engine
of the families optimum-intel cannot export), beside (d) in the same way. Each is loaded, warmed up with a
one-step call, then timed on ``--images`` calls of one image, in ``--rounds`` interleaved rounds (a b c … a b c, see
xeonsd.bench.rounds); the table gives the median seconds per image over the rounds with their min-max, and the
median of each round's ratio to that round's (a). The FLOP floor is the FLOPs (d) executes per image (text encoder, ``steps`` UNet calls at batch 2 for
classifier-free guidance, VAE decoder; counted with ``torch.utils.flop_counter`` on the same networks) divided by
the bf16 matmul peak measured in the same run (the median of probes before and after the variants; probes
more than 15 % apart end the output with "machine unstable: read the ratios, not the seconds"); the floor at the fp32 peak is printed too, and which precision the
OpenVINO CPU plugin runs in on this machine.

Default: the full SD1.5 architecture (``make-tiny-model --arch sd15``) at 512x512, 20 steps, as the recipe;
``--arch`` takes every ``make-tiny-model --arch``, at its own resolution (``--height``/``--width`` change it): ``sdxl``
the full SDXL base architecture at 1024x1024, ``sd21`` 768, ``flux`` (FLUX.1-dev; ``--depth D``: D double-stream
and 2D single-stream blocks at FLUX.1's widths, the real model 19, its own model directory per depth) and ``sd35m``
(SD3.5-medium) at 1024, the test-size ``tiny``, ``tiny-v``, ``tiny-xl``, ``tiny-flux`` and ``tiny-sd3`` at 64.
``--quick``: 256x256, 4 steps. Exports are cached in ``--workdir`` and reused by later runs.

On FLUX.1 and SD3 (:mod:`xeonsd.bench.generate_flow`) there is no concept: every variant runs the plain base model
on the prompt without the concept's token, with the family's guidance (SD3: classifier-free, 2 transformer calls'
worth per step; FLUX.1-dev: its guidance embedding, 1) and T5 at the export's prompt length, and the FLOP count is
the text encoders, ``steps`` transformer calls and the VAE decoder. A variant whose export ``xeonsd export``
refuses for the model ((g) and (i): hybrid int8 calibrates UNet calls; (h) and (i): ToMe merges a UNet's tokens)
is skipped, with one line giving the export's reason, and the others run.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

from xeonsd.assets.models import arch_names, arch_resolution
from xeonsd.bench import rounds as rnd
from xeonsd.bench.generate_flow import flow_family, transformer_calls_per_step
from xeonsd.bench.generate_pipelines import (
    Bench,
    Result,
    model_and_concept,
    prompt_for,
    time_ov,
    time_torch,
    time_torch_engine,
)
from xeonsd.bench.generate_report import format_table, pipeline_flops
from xeonsd.fsutil import atomic_file
from xeonsd.openvino.quantize import DEFAULT_SAMPLES

log = logging.getLogger(__name__)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure the variants ``args.only`` names, in order, and return the report (``format_table`` prints it)."""
    import openvino as ov

    from xeonsd.cpu import cpu_info

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model, embeds = model_and_concept(args, workdir)
    rnd.probes(1, min(0.2, args.probe_seconds), args.peak_size)  # warm-up, not kept
    before = rnd.probes(args.probes, args.probe_seconds, args.peak_size)
    peaks = {d: rnd.spread([p["peak"] for p in before if p["dtype"] == d])["median"] for d in ("bf16", "fp32")}
    log.info("matmul peaks: bf16 %.3f TFLOP/s, fp32 %.3f TFLOP/s", peaks["bf16"] / 1e12, peaks["fp32"] / 1e12)
    flops = pipeline_flops(model, args.height, args.width, args.steps)
    ov_precision = str(ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT"))

    bench = Bench(args, model, embeds, workdir)
    _measure_variants(bench, peaks, flops)
    after = rnd.probes(args.probes, args.probe_seconds, args.peak_size)
    stable = rnd.stability(before, after)
    peaks = {k: v["peak"]["median"] for k, v in stable["by_dtype"].items()}
    cpu = cpu_info()
    timed = {r.key: r.rounds_s for r in bench.results if r.rounds_s}
    over_d = {}  # (d) / variant within each round: (g)'s, (h)'s, (i)'s and (j)'s speed-up
    for key in ("g", "h", "i", "j"):
        if key in timed and "d" in timed:
            speedups = rnd.per_round_ratios(timed["d"], timed[key])
            over_d[key] = {"speedup_rounds": speedups, "speedup": rnd.spread(speedups)}

    flow = flow_family(model)
    return {
        "model": str(model),
        "family": flow.name if flow is not None else None,  # FLUX.1 / SD3 (None: a UNet family)
        "concept": None if embeds is None else str(embeds),
        "transformer_calls_per_step": None if flow is None else transformer_calls_per_step(flow.spec),
        "height": args.height,
        "width": args.width,
        "steps": args.steps,
        "images": args.images,
        "seed": args.seed,
        "prompt": prompt_for(embeds),
        "warmup": args.warmup,
        "results": [asdict(r) for r in bench.results],
        "flops_per_image": flops,
        "matmul_peak_flops": peaks,
        "openvino_cpu_precision": ov_precision,
        "export_seconds": bench.exports,
        "g_vs_d": bench.pixels.get("g"),
        "cpu": {"model": cpu.model, "native_int8": cpu.native_int8, "amx": cpu.amx_bf16},
        "rounds": args.rounds,
        "schedule": [key for _, key in rnd.schedule([r.key for r in bench.results if r.rounds_s], args.rounds)],
        "g_over_d": over_d.get("g"),
        "tome_ratio": args.tome,
        "tome_vs_d": {k: {**over_d[k], **bench.pixels.get(k, {})} for k in ("h", "i") if k in over_d},
        "torch_engine_vs_d": {**over_d["j"], **bench.pixels.get("j", {})} if "j" in over_d else None,
        "matmul_probes_flops": {"before": before, "after": after},
        "machine": stable,
    }


def _measure_variants(bench: Bench, peaks: dict[str, float], flops: dict[str, float]) -> None:
    """(a) to (j) into ``bench.results``, and how the images of (g), (h), (i) and (j) differ from (d)'s into
    ``bench.pixels``."""
    from xeonsd.openvino.manifest import StaticShape
    from xeonsd.openvino.quantize import QuantizeOptions

    args, model, embeds, only = bench.args, bench.model, bench.embeds, set(bench.args.only)
    static = StaticShape(batch_size=1, height=args.height, width=args.width, num_images_per_prompt=1)
    size = f"{args.height}x{args.width}"

    bench.measure("a", "diffusers PyTorch fp32", lambda: time_torch(model, embeds, args, bf16=False))
    gc.collect()
    if "b" in only:
        if peaks["bf16"] >= peaks["fp32"] or args.bf16 == "run":
            bench.measure("b", "PyTorch bf16 autocast", lambda: time_torch(model, embeds, args, bf16=True))
        else:
            bench.results.append(_bf16_not_run(peaks, flops))
    images: dict[str, list] = {key: [] for key in "dghij"}  # each one's first image
    quantize = QuantizeOptions(samples=args.calibration_samples)
    static_kind = f"static-{size}"
    tome_name, both_name = f"OpenVINO static {size} ToMe {args.tome:g}", f"OpenVINO ToMe {args.tome:g} + hybrid {size}"
    plans = {
        "c": _OvVariant("OpenVINO dynamic shapes", "dynamic", None, "fp32"),
        "d": _OvVariant(f"OpenVINO static {size}", static_kind, static, "fp32", keep=images["d"]),
        "e": _OvVariant(f"OpenVINO static {size} int8 weights", static_kind, static, "int8"),
        "f": _OvVariant(f"OpenVINO GenAI static {size}", static_kind, static, "fp32", engine="genai"),
        "g": _OvVariant(f"OpenVINO static {size} hybrid int8", static_kind, static, "int8", quantize, keep=images["g"]),
        "h": _OvVariant(tome_name, static_kind, static, "fp32", tome=args.tome, keep=images["h"]),
        "i": _OvVariant(both_name, static_kind, static, "int8", quantize, tome=args.tome, keep=images["i"]),
    }
    for key, v in plans.items():
        if key not in only:
            continue
        ov_dir = bench.export_or_skip(key, v.name, v.kind, v.static, v.weight_format, v.quantize, tome=v.tome)
        if ov_dir is not None:
            bench.measure(key, v.name, lambda d=ov_dir, v=v: time_ov(d, v.engine, args, v.keep))
    if "j" in only:
        import torch

        from xeonsd.torch_engine import torch_dtype

        name = f"PyTorch engine {'bf16' if torch_dtype() == torch.bfloat16 else 'fp32'} (--engine torch)"
        bench.measure("j", name, lambda: time_torch_engine(model, embeds, args, images["j"]))
    bench.measure_rounds(args.rounds)
    for key in "ghij":
        if images[key] and images["d"]:
            bench.pixels[key] = _pixel_difference(images[key], images["d"], args.seed)


class _OvVariant(NamedTuple):
    """One OpenVINO variant: its name, the export it runs on (kind, static shape, weights, hybrid int8, ToMe ratio),
    the engine, and the list its first image goes to (None: not kept)."""

    name: str
    kind: str
    static: Any
    weight_format: str
    quantize: Any = None
    tome: float = 0.0
    engine: str = "optimum"
    keep: list | None = None


def _bf16_not_run(peaks: dict[str, float], flops: dict[str, float]) -> Result:
    """(b) on a CPU without native bf16: not run (hours per image), with the time the bf16 peak projects."""
    projected = flops["total"] / peaks["bf16"]
    return Result(
        "b",
        "PyTorch bf16 autocast",
        note=f"not run: bf16 matmul peak {peaks['bf16'] / 1e12:.4f} TFLOP/s is below fp32 "
        f"({peaks['fp32'] / 1e12:.3f}), no native bf16 on this CPU; ~{projected:,.0f} s/image "
        "projected (--bf16 run forces it)",
    )


def _pixel_difference(image: list, image_d: list, seed: int) -> dict[str, Any]:
    import numpy as np

    diff = np.abs(np.asarray(image[0], dtype=np.float64) - np.asarray(image_d[0], dtype=np.float64)).mean()
    return {"mean_abs_pixel_diff": round(float(diff), 3), "seed": seed}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xeonsd bench generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="diffusers pipeline directory (default: a random-weight --arch model in --workdir)")
    p.add_argument(
        "--arch",
        choices=arch_names(),
        default="sd15",
        help="the random-weight model built in --workdir when --model is not given (make-tiny-model --arch)",
    )
    p.add_argument(
        "--depth",
        type=int,
        help="the full-size transformers only: their blocks cut to D (make-tiny-model --help)",
    )
    p.add_argument("--workdir", default="bench-generate", help="models, exports and results (reused between runs)")
    p.add_argument(
        "--height", type=int, help="default: the model's resolution (SD 1.5 512, SDXL, FLUX.1, SD3 1024, tiny 64)"
    )
    p.add_argument("--width", type=int, help="default: the model family's resolution")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--images", type=int, default=1, help="timed images per variant and round (one per call)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds: each variant runs once per round")
    p.add_argument("--probes", type=int, default=3, help="matmul peak probes per dtype, before and after the variants")
    p.add_argument("--peak-size", type=int, default=4096, help="largest matrix side of the matmul peak probes")
    p.add_argument("--probe-seconds", type=float, default=1.0, help="seconds of products per probe (all its sizes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="256x256 and 4 steps")
    p.add_argument("--only", default="abcdefghij", help="variants to run, e.g. 'ad' ('g', 'h', 'i', 'j' run 'd' too)")
    p.add_argument("--tome", default="0.5", metavar="RATIO", help="(h), (i): the token merging ratio (export --tome)")
    p.add_argument(
        "--calibration-samples",
        type=int,
        default=DEFAULT_SAMPLES,
        help="(g): UNet calls recorded to calibrate the hybrid int8 export",
    )
    p.add_argument("--bf16", choices=["auto", "run"], default="auto", help="auto: skip (b) without native bf16")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the one-step warm-up call")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.height, args.width, args.steps = 256, 256, 4
    if min(args.images, args.steps, args.rounds, args.probes) < 1:
        raise SystemExit("xeonsd bench generate: error: --images, --steps, --rounds and --probes must be at least 1")
    if args.calibration_samples < 1:
        raise SystemExit("xeonsd bench generate: error: --calibration-samples must be at least 1")
    from xeonsd.assets.models import check_depth
    from xeonsd.openvino.tome import check_ratio

    try:
        check_depth(args.arch, args.depth, args.model)
        args.tome = check_ratio(args.tome)  # its TomeError is a ValueError
    except ValueError as exc:
        raise SystemExit(f"xeonsd bench generate: error: {exc}") from None
    only = set(args.only) & set("abcdefghij")
    args.only = sorted(only | {"d"} if only & set("ghij") else only)  # (g), (h), (i), (j) are judged against (d)
    if args.tome == 0 and only & set("hi"):
        raise SystemExit("xeonsd bench generate: error: (h) and (i) need --tome above 0")
    if args.model:
        from xeonsd.modelfiles.modelsource import ModelSourceError, check_model_source

        try:  # the bench reads the directory itself (configs, FLOP count): a Hub id will not do
            check_model_source(args.model, flag="--model", hub=False)
        except ModelSourceError as exc:
            print(f"xeonsd bench generate: error: {exc}", file=sys.stderr)
            return 2
    if not args.quick and (args.height is None or args.width is None):
        from xeonsd.families import detect_family

        size = detect_family(args.model).default_resolution if args.model else arch_resolution(args.arch)
        args.height, args.width = args.height or size, args.width or size
    report = run(args)
    table = format_table(report)
    print(table)
    out = Path(args.workdir) / f"bench-generate-{args.width}x{args.height}-{args.steps}steps.json"
    with atomic_file(out, "w") as fh:
        json.dump({**report, "table": table}, fh, indent=2)
    print(f"results: {out}")
    print("\n".join(rnd.verdict_lines(report["machine"])))
    return 0
