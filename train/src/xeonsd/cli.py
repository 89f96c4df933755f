"""xeonsd: fine-tune Stable Diffusion on Xeon CPUs (over MPI), export to OpenVINO, generate.

Each subcommand's module is imported only when that subcommand runs, so ``xeonsd --help`` is instant and a
node that only generates does not need the training stack.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path
from typing import Any, TextIO


def _make_tiny_model(args: argparse.Namespace) -> int:
    def run(console: TextIO) -> int:
        from xeonsd.assets import make_tiny_model

        out = make_tiny_model(
            Path(args.out), arch=args.arch, seed=args.seed, depth=args.depth, configs_only=args.configs_only
        )
        print(out, file=console)
        return 0

    return _quietly(args, args.out, run)


def _make_dataset(args: argparse.Namespace) -> int:
    def run(console: TextIO) -> int:
        from xeonsd.assets import make_dataset

        for p in make_dataset(
            Path(args.out),
            count=args.count,
            size=args.size,
            seed=args.seed,
            captions=args.captions,
            token=args.token,
            sizes=args.sizes,
        ):
            print(p, file=console)
        return 0

    return _quietly(args, args.out, run)


def _console_flags(argv: list[str]) -> tuple[bool, str | None, list[str]]:
    """``xeonsd train``'s console flags (-v/--verbose, --log FILE), and the trainer's own arguments without them."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--log")
    known, rest = p.parse_known_args(argv)
    return known.verbose, known.log, rest


def _train_log(argv: list[str]) -> Path:
    """Where ``xeonsd train`` keeps the libraries' output: libraries.log in the output directory (one rank), or
    libraries-rank<r>.log (each rank of a job, in the output directory on its own node)."""
    from xeonsd.cluster.launch import detect_ranks
    from xeonsd.trainer.config import TrainConfig

    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--output_dir", default=TrainConfig.output_dir)
    out = Path(p.parse_known_args(argv)[0].output_dir)
    info = detect_ranks()
    return out / ("libraries.log" if info.world_size == 1 else f"libraries-rank{info.rank}.log")


def _train(rest: list[str]) -> int:
    """The trainer with a quiet console: its own lines (progress, result, errors) on the console, the libraries'
    chatter in the log (``-v``: on the console too). ``--help`` and ``--dry_run`` print as they are."""
    from xeonsd.console import quiet_console

    verbose, log, rest = _console_flags(rest)
    if any(a in ("-h", "--help") or a.startswith(("--dry_run", "--dry-run")) for a in rest):  # they only print
        from xeonsd.trainer.loop import main as train_main

        return train_main(rest)
    log_path = Path(log) if log else _train_log(rest)
    with quiet_console(log_path, verbose=verbose, both=True) as console:
        from xeonsd.trainer.loop import main as train_main

        return train_main(rest, console, _open_class_renderer)


def _open_class_renderer(*args):  # noqa: ANN002, ANN202 - xeonsd.trainer.prior.ClassRendererOpener
    """--class_export's OpenVINO side, imported only when class images are to be made (the trainer may not import
    xeonsd.openvino)."""
    from xeonsd.openvino.class_images import open_class_renderer

    return open_class_renderer(*args)


# The errors a command reports itself, in one line (everything else is a traceback).
COMMAND_ERRORS = (ValueError, FileExistsError, PermissionError, FileNotFoundError, NotADirectoryError)


def _quietly(args: argparse.Namespace, out: str, run) -> int:
    """Run ``run(console)`` with the libraries' chatter in the log beside ``out`` (``-v``: on the console too)."""
    from xeonsd.console import log_path_beside, quiet_console

    log_path = Path(args.log) if args.log else log_path_beside(out)
    with quiet_console(log_path, verbose=args.verbose, expected=COMMAND_ERRORS) as console:
        return run(console)


def _openvino(args: argparse.Namespace) -> int:
    """``xeonsd export`` or ``generate``: ``main_args`` of :mod:`xeonsd.openvino.export` or ``.generate``."""
    main_args = importlib.import_module(f"xeonsd.openvino.{args.command}").main_args
    return _quietly(args, args.out, lambda console: main_args(args, console))


def _add_console_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show the libraries' output (notices, progress bars, OpenVINO's own lines) on the console too",
    )
    p.add_argument(
        "--log", metavar="FILE", help="where the libraries' output goes (default: OUT.log beside the output)"
    )


def _add_export_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="export a pipeline (with its learned concept) to OpenVINO",
        description="Export SRC (a diffusers pipeline directory or Hub id) to the OpenVINO directory OUT. "
        "Static shapes by default, the recipe's: batch 5, 1 image per prompt, at the model family's resolution "
        "(SD 1.5 512x512, SDXL 1024x1024).",
    )
    from xeonsd.flags import add_flags
    from xeonsd.openvino.export_args import ExportRequest

    add_flags(p, ExportRequest, dashes=True)
    _add_console_flags(p)
    p.set_defaults(func=_openvino)


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate images from an OpenVINO export",
        description="Generate PNGs, grid.png and timings.json from an `xeonsd export` directory.",
    )
    from xeonsd.flags import add_flags
    from xeonsd.openvino.generate_args import GenerateCommand, GenerateOptions

    add_flags(p, GenerateCommand, dashes=True)
    add_flags(p, GenerateOptions, dashes=True)
    _add_console_flags(p)
    p.set_defaults(func=_openvino)


def _report(args: argparse.Namespace) -> int:
    from xeonsd.ops.report import write_report

    print(write_report(Path(args.run_dir)))
    return 0


BENCHES = ("train", "generate", "layout", "serve", "optimizer", "memory")  # each is xeonsd.bench.<name>.main


def _bench(what: str, rest: list[str]) -> int:
    return importlib.import_module(f"xeonsd.bench.{what}").main(rest)


def _add_make_tiny_model(sub: Any) -> None:
    p = sub.add_parser(
        "make-tiny-model", help="write a random-weight Stable Diffusion (or SDXL) pipeline (offline test model)"
    )
    p.add_argument("out", help="output directory (must not exist or be empty)")
    p.add_argument(
        "--arch",
        choices=[
            *("tiny", "tiny-v", "tiny-xl", "tiny-flux", "tiny-sd3", "tiny-flux2", "tiny-zimage", "tiny-qwenimage"),
            *("sd15", "sd21", "sdxl", "sd35m", "flux", "flux2-klein", "zimage", "qwenimage"),
        ],
        default="tiny",
        help="tiny: for tests; tiny-v: SD 2.x-style (v-prediction) for tests; tiny-xl: SDXL-style for tests; "
        "tiny-flux/tiny-sd3: FLUX.1/SD3.5-style (flow matching) for tests; tiny-flux2/tiny-zimage/tiny-qwenimage: "
        "FLUX.2-klein/Z-Image/Qwen-Image-style (Qwen text encoders) for tests; sd15/sd21/sdxl/sd35m/flux/"
        "flux2-klein/zimage/qwenimage: full size (sd35m, flux and the last three are written in bf16)",
    )
    p.add_argument(
        "--depth",
        type=int,
        default=None,
        help="the full-size transformers only: --arch flux: D double-stream and 2D single-stream blocks (the real "
        "model: 19); flux2-klein: D double and 4D single (real: 5); zimage: D main layers (real: 30); qwenimage: D "
        "blocks (real: 60)",
    )
    p.add_argument(
        "--configs-only",
        action="store_true",
        help="flux2-klein/zimage/qwenimage and their tiny archs: write the configs and the tokenizer, no weights "
        "(for `xeonsd train --dry_run`'s memory estimate of a model that does not fit this machine)",
    )
    p.add_argument("--seed", type=int, default=0)
    _add_console_flags(p)
    p.set_defaults(func=_make_tiny_model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xeonsd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser(
        "train",
        help="textual inversion, LoRA or full fine-tuning (`xeonsd train --help` for its flags)",
        add_help=False,
    )

    _add_make_tiny_model(sub)

    p = sub.add_parser("make-dataset", help="write synthetic training images (stand-in for the dicoo images)")
    p.add_argument("out", help="output directory (must not exist or be empty)")
    p.add_argument("--count", type=int, default=5)
    p.add_argument("--size", type=int, default=128, help="image side in pixels")
    p.add_argument(
        "--sizes",
        choices=["square", "mixed"],
        default="square",
        help="square: every image --size x --size; mixed: mixed aspect ratios (1:1 to 16:9 and 9:16), each with "
        "1.25-1.75 x --size as the side of its square of equal area (for --buckets at --resolution --size)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--captions",
        choices=["metadata", "sidecar", "txt"],
        help="also write captions: metadata.jsonl, a .txt beside each image, or captions.txt",
    )
    p.add_argument("--token", default="<dicoo>", help="the concept's placeholder in the captions")
    _add_console_flags(p)
    p.set_defaults(func=_make_dataset)

    _add_export_parser(sub)
    _add_generate_parser(sub)
    from xeonsd.serve.command import add_parser as add_serve_parser  # argparse only: cheap to import

    add_serve_parser(sub)

    sub.add_parser(
        "doctor", help="check this node and train one step with the job's arguments (`-- TRAIN_ARGS`)", add_help=False
    )

    sub.add_parser(
        "hello", help="under mpirun: every rank joins the trainer's process group and answers", add_help=False
    )

    p = sub.add_parser("report", help="write report.html for a run directory (command, loss, throughput, images)")
    p.add_argument("run_dir", help="directory with run.json, metrics.jsonl, loss.png, images/ …")
    p.set_defaults(func=_report)

    from xeonsd.jobs.cli import add_parsers as add_job_parsers  # stdlib only: cheap to import

    add_job_parsers(sub)  # jobstatus, runjson, slurmjob

    p = sub.add_parser("bench", help=f"benchmarks (`xeonsd bench {'|'.join(BENCHES)} --help`)", add_help=False)
    p.add_argument("what", choices=BENCHES)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Subcommands with many flags of their own parse them themselves, before the parser of the others is built
    # (which imports modules of the OpenVINO side: a training rank has no use for them).
    if argv and argv[0] == "train":
        return _train(argv[1:])
    if argv and argv[0] == "doctor":
        from xeonsd.ops.doctor import main as doctor_main

        return doctor_main(argv[1:])
    if argv and argv[0] == "hello":
        from xeonsd.cluster.hello import main as hello_main

        return hello_main(argv[1:])
    if len(argv) > 1 and argv[0] == "bench" and argv[1] in BENCHES:
        return _bench(argv[1], argv[2:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except COMMAND_ERRORS as exc:
        print(f"xeonsd {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
