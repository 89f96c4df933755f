"""``xeonsd bench train``: s/step, executed FLOPs (attention included), share of the matmul peak, peak RSS and
all-reduce bytes of the trainer (``--method textual_inversion|lora|full``) on the full SD 1.5 architecture, with
each optimisation switched off in turn.

Every variant is a real ``xeonsd train`` process (so its peak RSS is its own: :mod:`.train_runs`), on the same
model, images, seed and step count. The variants run interleaved, ``--rounds`` rounds of A B C …
(xeonsd.bench.rounds): s/step is the median over the rounds, and "x optimized" the median of each round's ratio to
the optimized run of that round. The matmul peaks are probed before and after the variants (xeonsd.flops, as
``bench generate`` does); probes that differ by more than 15 % end the output with "machine unstable: read the
ratios, not the seconds". The bytes all-reduced per step are measured on a real 2-rank ``mpirun`` run (the
profiler's record of the collectives), beside what the trainer computes. Figures are printed, not asserted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from xeonsd import step_profile as sp
from xeonsd.assets.models import arch_names
from xeonsd.bench import diffusers_examples as dx
from xeonsd.bench import rounds as rnd
from xeonsd.bench.targets import bench_targets
from xeonsd.bench.train_report import format_table, profile_summary, step_seconds, summarize
from xeonsd.bench.train_runs import measure_allreduce, run_rounds
from xeonsd.bench.train_variants import ADAPTER_VARIANTS, EXTRA_VARIANTS, Variant, method_args, variants_for
from xeonsd.contracts.method_names import METHODS
from xeonsd.fsutil import atomic_file

log = logging.getLogger(__name__)

DEFAULT_MODEL_CACHE = Path(os.environ.get("XEONSD_CACHE", Path.home() / ".cache" / "xeonsd")) / "sd15"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xeonsd bench train", description=__doc__.splitlines()[0])
    p.add_argument("--method", choices=METHODS, default="textual_inversion")
    p.add_argument("--no-ranks2", action="store_true", help="skip the 2-rank run that measures the all-reduce bytes")
    p.add_argument(
        "--model",
        default=None,
        help=f"pipeline directory (default: the sd15 architecture built once in {DEFAULT_MODEL_CACHE})",
    )
    p.add_argument(
        "--arch",
        choices=arch_names(),
        default="sd15",
        help="what to build when --model is not given (make-tiny-model's archs: sdxl is the SDXL base architecture, "
        "13 GB on disk; sd35m SD3.5-medium and flux FLUX.1-dev's widths, written in bf16)",
    )
    p.add_argument(
        "--depth",
        type=int,
        default=None,
        help="the full-size transformers only (make-tiny-model --help): their blocks cut to D; "
        "per-block figures scale linearly to the full depth (docs/benchmarks.md)",
    )
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--images", type=int, default=5, help="training images (each is VAE-encoded twice for the cache)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant (after warm-up)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first also counts FLOPs)")
    p.add_argument(
        "--dtype",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="precision of the optimized run; auto: bf16 where the CPU has AMX or AVX512-BF16, else fp32",
    )
    p.add_argument("--only", nargs="*", default=None, help="variant names to run (default: the four standard ones)")
    p.add_argument(
        "--extra",
        action="store_true",
        help="also try channels_last, the per-tensor AdamW, torch.compile, torch's SDPA unfolded (--attention sdpa), "
        "for LoRA the frozen linears in int8 (--base_precision int8), for LoRA and full --random_flip (the mirrors "
        "encoded at start-up: see the start-up column)",
    )
    p.add_argument(
        "--adapters",
        action="store_true",
        help="--method lora: also train DoRA, LoKr and LoHa (--adapter), interleaved with plain LoRA, each with its "
        "trained parameters",
    )
    p.add_argument(
        "--pairs",
        action="store_true",
        default=None,
        help="train on image pairs (a reference image each, --cond_image_column: make-dataset --pairs), for the "
        "families that take reference images; the default for those that cannot train without (Qwen-Image-Edit)",
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds: each variant runs once per round")
    p.add_argument("--peak-size", type=int, default=4096, help="largest matrix side of the matmul peak probes")
    p.add_argument("--probes", type=int, default=3, help="matmul peak probes per dtype, before and after the variants")
    p.add_argument("--probe-seconds", type=float, default=1.0, help="seconds of products per probe (all its sizes)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile each variant's last warm-up step (needs --warmup 2+): seconds, TFLOP/s and share of the "
        "matmul peak per class of work (xeonsd.step_profile)",
    )
    p.add_argument(
        "--diffusers-examples",
        type=Path,
        default=None,
        metavar="DIR",
        help="the examples/ folder of a diffusers checkout at the pinned tag: adds the variant 'diffusers example' "
        "(diffusers' own script for the job, on the same model, images and steps) and judges the 2x target",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    checked = _checked(args)
    if checked is None:
        return 2
    model, family = checked
    from xeonsd.cpu import cpu_info

    cpu = cpu_info()
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if cpu.native_bf16 else "fp32")
    variants = _variants(args, family, cpu, dtype)
    if variants is None:
        return 2
    rnd.probes(1, 0.2, args.peak_size)  # warm-up, not kept
    before = rnd.probes(args.probes, args.probe_seconds, args.peak_size)
    runs, measured, why = _measure(args, model, dtype, variants)
    after = rnd.probes(args.probes, args.probe_seconds, args.peak_size)
    stable = rnd.stability(before, after)
    # xeonsd.flops gives FLOP/s; this table is in TFLOP/s: the median of every probe, before and after.
    peaks = {k: v["peak"]["median"] / 1e12 for k, v in stable["by_dtype"].items()}
    log.info("matmul peaks: %s", peaks)
    stats = rnd.summarize(
        {n: [step_seconds(r["rows"], args.warmup) for r in rs] for n, rs in runs.items()}, baseline=variants[0].name
    )
    dtypes = {v.name: v.name if v.name in ("bf16", "fp32") else dtype for v in variants}  # each one's training dtype
    results = [summarize(v.name, runs[v.name], args.warmup, peaks[dtypes[v.name]], stats[v.name]) for v in variants]
    title = f"{args.method} on {family.label}" + (" (image pairs: a reference image each)" if args.pairs else "")
    print(format_table(results, peaks, dtype, cpu.model, title), flush=True)
    if args.profile:
        for v, r in zip(variants, results, strict=True):
            if v.name == dx.VARIANT:  # an unchanged script: nothing inside it records its step
                print(f"{v.name}: not profiled (--profile records xeonsd train's own steps)")
                continue
            vdtype = dtypes[v.name]
            r["profile"] = profile_summary(runs[v.name], peaks[vdtype])
            print(sp.format_profile(v.name, r["profile"]["classes"], r["profile"]["wall_s"], peaks[vdtype], vdtype))
    optimized = results[0] if variants[0].name == "optimized" else None
    reference = next((r for r in results if r["variant"] == dx.VARIANT), None)
    targets = bench_targets(cpu, dtype, optimized, family.name, args.method, reference)
    print("\n".join(t["line"] for t in targets), flush=True)
    computed = results[0]["allreduce_bytes"]
    if measured is not None:
        print(
            f"all-reduce per step, measured on a 2-rank mpirun run: {measured:,} B (the trainer computes "
            f"{computed:,} B)",
            flush=True,
        )
    else:
        print(f"all-reduce per step on 2 ranks: not measured: {why}", flush=True)
    if args.json:
        summary = {
            "cpu": cpu.model,
            "method": args.method,
            "family": family.name,
            "family_label": family.label,
            "resolution": args.resolution,
            "pairs": bool(args.pairs),
            "dtype": dtype,
            "peak_tflops": peaks,
            "model": str(model),
            "results": results,
            "allreduce_bytes_measured_2ranks": measured,
            "allreduce_not_measured": why or None,
            "rounds": args.rounds,
            "schedule": [name for _, name in rnd.schedule([v.name for v in variants], args.rounds)],
            "matmul_probes_flops": {"before": before, "after": after},
            "machine": {k: stable[k] for k in ("difference", "tolerance", "unstable")},
            "targets": targets,
        }
        with atomic_file(args.json, "w") as fh:
            json.dump(summary, fh, indent=2)
    print("\n".join(rnd.verdict_lines(stable)), flush=True)
    return 0


def _checked(args: argparse.Namespace):
    """The model and its family once every flag is checked; None after printing what is wrong."""
    if args.rounds < 1 or args.probes < 1:
        return _error("--rounds and --probes must be at least 1")
    if args.adapters and args.method != "lora":
        return _error(f"--adapters compares LoRA's adapter types: it needs --method lora, not {args.method}")
    if args.profile and args.warmup < 2:
        return _error(
            "--profile needs --warmup 2 or more (the first step counts the FLOPs, the last warm-up step is profiled)"
        )
    if args.diffusers_examples is not None and not args.diffusers_examples.is_dir():
        return _error(
            f"--diffusers-examples {args.diffusers_examples}: not a folder (give the examples/ folder of a diffusers "
            "source checkout)"
        )
    model = resolve_model(args)
    if model is None:
        return None
    from xeonsd.families import detect_family

    family = detect_family(model)
    args.reference_script = None
    if args.diffusers_examples is not None:
        try:
            args.reference_script = dx.script_for(args.diffusers_examples, args.method, family.spec)
            dx.check_imports(args.method)
        except dx.ExamplesError as exc:
            return _error(str(exc))
    if args.pairs and not family.spec.reference_images:
        return _error(f"--pairs: {family.label} takes no reference image; leave out --pairs")
    if args.pairs is None:
        args.pairs = family.spec.reference_required
    if family.is_flow and args.method == "textual_inversion":
        return _error(
            f"--method textual_inversion is not supported on {family.label} (the trainer refuses it: no trainer "
            "trains embeddings for its CLIP + T5 text side); use --method lora or full"
        )
    return model, family


def _error(message: str) -> None:
    """Print ``message`` as the command's error (the caller returns None: exit status 2)."""
    print(f"xeonsd bench train: error: {message}", file=sys.stderr)


def _variants(args: argparse.Namespace, family, cpu, dtype: str) -> list[Variant] | None:
    """The variants this run measures (``--only``, ``--extra``, the CPU's bf16); None after printing an unknown name."""
    extra = [
        v
        for v in EXTRA_VARIANTS
        if args.extra
        and not (family.is_flow and v.name == "channels_last")
        and args.method in (v.methods or (args.method,))
    ]
    variants = list(variants_for(args.method, dtype)) + extra + (list(ADAPTER_VARIANTS) if args.adapters else [])
    if args.reference_script is not None:
        variants.append(Variant(dx.VARIANT, (), f"diffusers' {args.reference_script.name}, unchanged"))
    if args.only:
        unknown = set(args.only) - {v.name for v in variants}
        if unknown:
            return _error(f"unknown variant(s) {sorted(unknown)}")
        variants = [v for v in variants if v.name in args.only]
    if not cpu.native_bf16 and not args.only:
        log.warning("%s has no AMX or AVX512-BF16: skipping the bf16 variant (pass --only bf16 to force it)", cpu.model)
        variants = [v for v in variants if v.name != "bf16"]
    return variants


def _measure(args: argparse.Namespace, model: str | Path, dtype: str, variants: list[Variant]):
    """The interleaved rounds of the variants, then the 2-rank all-reduce run: (runs by name, bytes, why not)."""
    from xeonsd.assets import make_dataset, make_pairs

    env = dict(os.environ, HF_HUB_OFFLINE="1")
    with tempfile.TemporaryDirectory(prefix="xeonsd-bench-") as tmp:
        data = Path(tmp) / "data"
        if args.pairs:
            make_pairs(data, count=args.images, size=args.resolution)
        else:
            make_dataset(data, count=args.images, size=args.resolution)
        base_args = train_args(args, model, data, dtype) + (["--cond_image_column=cond_image"] if args.pairs else [])
        if args.reference_script is not None:
            job = {
                "method": args.method,
                "model": str(model),
                "images": args.images,
                "resolution": args.resolution,
                "steps": args.warmup + args.steps,
                "dtype": dtype,
                "seed": 7,
            }
            cmd = dx.reference_command(args.reference_script, Path(tmp), **job)
            variants = [replace(v, command=cmd) if v.name == dx.VARIANT else v for v in variants]
        runs = run_rounds(variants, args.rounds, base_args, Path(tmp), env)
        measured, why = (None, "skipped (--no-ranks2)")
        if not args.no_ranks2:
            measured, why = measure_allreduce(base_args, Path(tmp) / "ranks2", env)
    return runs, measured, why


def resolve_model(args: argparse.Namespace) -> str | Path | None:
    """``--model`` once checked (None after printing why it will not do), else the ``--arch`` model, built once."""
    from xeonsd.assets.models import check_depth, model_name
    from xeonsd.modelfiles.modelsource import ModelSourceError, check_model_source

    try:
        check_depth(args.arch, args.depth, args.model)
    except ValueError as exc:
        return _error(str(exc))
    if args.model is not None:
        try:  # the variants run with HF_HUB_OFFLINE=1: a Hub id must be in the Hub cache
            check_model_source(str(args.model), flag="--model", offline=True)
        except ModelSourceError as exc:
            return _error(str(exc))
        return args.model
    name = model_name(args.arch, args.depth)
    model = DEFAULT_MODEL_CACHE if name == "sd15" else DEFAULT_MODEL_CACHE.with_name(name)
    if not (model / "model_index.json").is_file():
        log.info("building the %s model once in %s", name, model)
        depth = ["--depth", str(args.depth)] if args.depth else []
        cmd = [sys.executable, "-m", "xeonsd.cli", "make-tiny-model", str(model), "--arch", args.arch, *depth]
        subprocess.run(cmd, check=True)  # in a process of its own: its memory is free again before the variants
    return model


def train_args(args: argparse.Namespace, model: str | Path, data: Path, dtype: str) -> list[str]:
    """The ``xeonsd train`` flags every variant shares (each adds its own)."""
    return [
        f"--pretrained_model_name_or_path={model}",
        f"--train_data_dir={data}",
        *method_args(args.method),
        f"--resolution={args.resolution}",
        "--train_batch_size=1",
        "--seed=7",
        f"--max_train_steps={args.warmup + args.steps}",
        *([f"--profile_step={args.warmup}"] if args.profile else []),
        "--learning_rate=2e-3",
        "--lr_warmup_steps=0",
        f"--mixed_precision={'bf16' if dtype == 'bf16' else 'no'}",
        "--checkpointing_steps=0",
        "--count_flops",
    ]
