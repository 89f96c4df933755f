"""``xeonsd serve``'s command line: its flags are :class:`~xeonsd.serve.options.ServeOptions`' fields
(:func:`add_parser`, called by :mod:`xeonsd.cli`, through :mod:`xeonsd.flags`) and the call into
:mod:`xeonsd.serve.server`, imported only when the command runs."""

from __future__ import annotations

import argparse


def _serve(args: argparse.Namespace) -> int:
    from xeonsd.serve.server import main_args

    return main_args(args)


def add_parser(sub: argparse._SubParsersAction) -> None:
    from xeonsd.flags import add_flags
    from xeonsd.serve.options import ServeOptions

    p = sub.add_parser(
        "serve",
        help="serve an export over HTTP: the OpenAI/OVMS images API with per-request LoRA (docs/serving.md)",
        description="Serve EXPORT_DIR (written by `xeonsd export`, static shape; or, --engine torch, a diffusers "
        "pipeline directory) on POST /v3/images/generations and /v1/images/generations, with the edits at "
        "/v3/images/edits and /v1/images/edits, GET /v1/models, /v2/health/live, /v2/health/ready and /metrics.",
    )
    add_flags(p, ServeOptions, dashes=True)
    p.set_defaults(func=_serve)
