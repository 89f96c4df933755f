"""xeonsd: fine-tune Stable Diffusion on Xeon CPUs (over MPI), export to OpenVINO, generate.

Each subcommand's module is imported only when that subcommand runs, so ``xeonsd --help`` is instant and a
node that only generates does not need the training stack.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from xeonsd.flags import add_flags, flag, from_args


class _ArchNames:
    """``make-tiny-model --arch``'s choices: the family folders' archs (:func:`xeonsd.assets.models.arch_names`),
    read only when that command parses or prints its help, so that building the parser imports no family."""

    def __iter__(self):
        from xeonsd.assets.models import arch_names

        return iter(arch_names())

    def __contains__(self, name: object) -> bool:
        return name in list(self)


def _make_asset(args: argparse.Namespace) -> int:
    """``xeonsd make-tiny-model`` or ``make-dataset``: :func:`xeonsd.assets.make_tiny_model` or ``make_dataset``
    with the command's flags; prints what it wrote."""

    def run(console: TextIO) -> int:
        from xeonsd import assets

        given = dataclasses.asdict(from_args(args.flags[0], args))
        written = getattr(assets, args.command.replace("-", "_"))(given.pop("out"), **given)
        for path in written if isinstance(written, list) else [written]:
            print(path, file=console)
        return 0

    return _quietly(args, args.out, run)


def _console_flags(argv: list[str]) -> tuple[bool, str | None, list[str]]:
    """``xeonsd train``'s console flags (-v/--verbose, --log FILE), and the trainer's own arguments without them."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _add_console_flags(p)
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
    if (refused := _refuse_flags(rest)) is not None:
        return refused
    log_path = Path(log) if log else _train_log(rest)
    with quiet_console(log_path, verbose=verbose, both=True) as console:
        from xeonsd.trainer.loop import main as train_main

        return train_main(rest, console, _open_class_renderer)


def _refuse_flags(argv: list[str]) -> int | None:
    """A single process's flags, checked before torch and the libraries load (seconds of imports): a flag of
    another method, a bad choice or value is refused at once, with the trainer's own message. The trainer checks
    them again, and everything past the flags (the data, the model); a job's ranks leave it to the trainer, which
    names the rank and takes the job down."""
    from xeonsd.cluster.launch import detect_ranks
    from xeonsd.trainer.argv import parse_config
    from xeonsd.trainer.config import ConfigError

    if detect_ranks().world_size > 1:
        return None
    try:
        parse_config(argv)
    except ConfigError as exc:
        print(f"xeonsd train: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return None


def _open_class_renderer(*args):  # noqa: ANN002, ANN202 - xeonsd.trainer.prior.ClassRendererOpener
    """--class_export's OpenVINO side, imported only when class images are to be made (the trainer may not import
    xeonsd.openvino)."""
    from xeonsd.openvino.class_images import open_class_renderer

    return open_class_renderer(*args)


# The errors a command reports itself, in one line (everything else is a traceback).
COMMAND_ERRORS = (ValueError, FileExistsError, PermissionError, FileNotFoundError, NotADirectoryError)


def _quietly(args: argparse.Namespace, out: str | Path, run) -> int:
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


def _add_command(sub: argparse._SubParsersAction, name: str, flags: tuple[type, ...], func, **parser_kw) -> None:
    """A subcommand whose flags are the fields of ``flags`` (:mod:`xeonsd.flags`, dashed), and the console flags."""
    p = sub.add_parser(name, **parser_kw)
    for cls in flags:
        add_flags(p, cls, dashes=True)
    _add_console_flags(p)
    p.set_defaults(func=func, flags=flags)


@dataclass(frozen=True)
class TinyModelArgs:
    """``xeonsd make-tiny-model OUT``: :func:`xeonsd.assets.make_tiny_model`'s arguments, each a flag."""

    out: Path = flag("output directory (must not exist or be empty)", positional=True)
    arch: str = flag(
        "tiny-*: a family's structure at 64 px, for tests (tiny: SD 1.x, tiny-v: SD 2.x, tiny-xl: SDXL); the others: "
        "a family's released widths with random weights, for benchmarks (the large ones written in bf16); each "
        "family's folder lists its own (xeonsd/families/<name>/assets.py)",
        default="tiny",
        choices=_ArchNames(),
    )
    depth: int | None = flag(
        "the full-size transformers only: D of the denoiser's blocks, the single-stream ones in the real model's "
        "proportion (--arch flux and flux-kontext: the real model has 19; flux2-klein: 5; zimage: 30; qwenimage "
        "and qwenimage-edit: 60; krea2: 28; flux2-dev: 8, with a thin text encoder of the real output width)",
        default=None,
    )
    configs_only: bool = flag(
        "the Qwen- and Mistral-encoder families' archs: write the configs and the tokenizer, no weights "
        "(for `xeonsd train --dry_run`'s memory estimate of a model that does not fit this machine)",
        default=False,
    )
    seed: int = flag("seed of the random weights", default=0)


@dataclass(frozen=True)
class DemoModelArgs:
    """``xeonsd make-demo-model OUT``: :func:`xeonsd.assets.make_demo_model`'s arguments, each a flag."""

    out: Path = flag("output directory (must not exist or be empty)", positional=True)
    seed: int = flag("seed of the weights and the pictures (the shipped model: 0)", default=0)


@dataclass(frozen=True)
class DatasetArgs:
    """``xeonsd make-dataset OUT``: :func:`xeonsd.assets.make_dataset`'s arguments, each a flag."""

    out: Path = flag("output directory (must not exist or be empty)", positional=True)
    count: int = flag("images to write", default=5)
    size: int = flag("image side in pixels", default=128)
    sizes: str = flag(
        "square: every image --size x --size; mixed: mixed aspect ratios (1:1 to 16:9 and 9:16), each with "
        "1.25-1.75 x --size as the side of its square of equal area (for --buckets at --resolution --size)",
        default="square",
        choices=("square", "mixed"),
    )
    seed: int = flag("seed of the images", default=0)
    captions: str | None = flag(
        "also write captions: metadata.jsonl, a .txt beside each image, or captions.txt",
        default=None,
        choices=("metadata", "sidecar", "txt"),
    )
    token: str = flag("the concept's placeholder in the captions", default="<dicoo>")
    pairs: bool = flag(
        "image pairs for edit training instead (--cond_image_column cond_image): a blue square per image, the same "
        "square red as its reference in ref/, metadata.jsonl with the instruction",
        default=False,
    )


def _report(args: argparse.Namespace) -> int:
    from xeonsd.ops.report import write_report

    print(write_report(Path(args.run_dir)))
    return 0


# each is xeonsd.bench.<name>.main
BENCHES = ("train", "generate", "layout", "serve", "optimizer", "memory", "attention")
# Commands that parse their own arguments: ``main(argv)`` of these modules.
OWN_PARSERS = {"doctor": "xeonsd.ops.doctor", "hello": "xeonsd.cluster.hello"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xeonsd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser(
        "train",
        help="textual inversion, LoRA or full fine-tuning (`xeonsd train --help` for its flags)",
        add_help=False,
    )

    _add_command(
        sub,
        "make-tiny-model",
        (TinyModelArgs,),
        _make_asset,
        help="write a random-weight Stable Diffusion (or SDXL) pipeline (offline test model)",
    )
    _add_command(
        sub,
        "make-demo-model",
        (DemoModelArgs,),
        _make_asset,
        help="pretrain the demo's small SD 1.x pipeline on captioned scenes (one thread, ~20 min; the repository "
        "ships it: xeonsd/assets/demo_model)",
    )
    _add_command(
        sub,
        "make-dataset",
        (DatasetArgs,),
        _make_asset,
        help="write synthetic training images (stand-in for the dicoo images)",
    )
    from xeonsd.openvino.export_args import ExportRequest  # flags only: cheap to import
    from xeonsd.openvino.generate_args import GenerateCommand, GenerateOptions

    _add_command(
        sub,
        "export",
        (ExportRequest,),
        _openvino,
        help="export a pipeline (with its learned concept) to OpenVINO",
        description="Export SRC (a diffusers pipeline directory or Hub id) to the OpenVINO directory OUT. "
        "Static shapes by default, the recipe's: batch 5, 1 image per prompt, at the model family's resolution "
        "(SD 1.5 512x512, SDXL 1024x1024).",
    )
    _add_command(
        sub,
        "generate",
        (GenerateCommand, GenerateOptions),
        _openvino,
        help="generate images from an OpenVINO export (or a diffusers pipeline in PyTorch)",
        description="Generate PNGs, grid.png and timings.json from an `xeonsd export` directory, or with --engine "
        "torch (auto: for a family without an OpenVINO export) from a diffusers pipeline directory.",
    )
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
    if argv and argv[0] in OWN_PARSERS:
        return importlib.import_module(OWN_PARSERS[argv[0]]).main(argv[1:])
    if len(argv) > 1 and argv[0] == "bench" and argv[1] in BENCHES:
        return importlib.import_module(f"xeonsd.bench.{argv[1]}").main(argv[2:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except COMMAND_ERRORS as exc:
        print(f"xeonsd {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
