"""The ``xeonsd`` command: one subcommand per job.

Each subcommand's module is imported only when that subcommand runs, so ``xeonsd --help`` is instant and a
node that only generates does not need the training stack.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _make_tiny_model(args: argparse.Namespace) -> int:
    from xeonsd.assets import make_tiny_model

    out = make_tiny_model(Path(args.out), arch=args.arch, seed=args.seed)
    print(out)
    return 0


def _make_dataset(args: argparse.Namespace) -> int:
    from xeonsd.assets import make_dataset

    for p in make_dataset(Path(args.out), count=args.count, size=args.size, seed=args.seed):
        print(p)
    return 0


def _train(args: argparse.Namespace, rest: list[str]) -> int:
    from xeonsd.train import main as train_main

    return train_main(rest)


def _bench(args: argparse.Namespace, rest: list[str]) -> int:
    if args.what == "train":
        from xeonsd.bench_train import main as bench_main
    else:
        from xeonsd.bench_generate import main as bench_main
    return bench_main(rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xeonsd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser("train", help="textual inversion (run `xeonsd train --help` for its flags)", add_help=False)

    p = sub.add_parser("make-tiny-model", help="write a random-weight Stable Diffusion pipeline (offline test model)")
    p.add_argument("out", help="output directory (must not exist or be empty)")
    p.add_argument("--arch", choices=["tiny", "sd15"], default="tiny", help="tiny: for tests; sd15: full SD1.5 size")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_make_tiny_model)

    p = sub.add_parser("make-dataset", help="write synthetic training images (stand-in for the dicoo images)")
    p.add_argument("out", help="output directory (must not exist or be empty)")
    p.add_argument("--count", type=int, default=5)
    p.add_argument("--size", type=int, default=128, help="image side in pixels")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_make_dataset)

    p = sub.add_parser("bench", help="benchmarks (`xeonsd bench train --help`)", add_help=False)
    p.add_argument("what", choices=["train", "generate"])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    # Subcommands with many flags of their own parse them themselves.
    if argv and argv[0] == "train":
        return _train(argparse.Namespace(), argv[1:])
    if argv and argv[0] == "bench" and len(argv) > 1 and argv[1] in ("train", "generate"):
        return _bench(argparse.Namespace(what=argv[1]), argv[2:])
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileExistsError, PermissionError) as exc:
        print(f"xeonsd {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
