"""``xeonsd serve``'s command line: its flags (:func:`add_parser`, called by :mod:`xeonsd.cli`) and the call into
:mod:`xeonsd.serve.server`, imported only when the command runs."""

from __future__ import annotations

import argparse

from xeonsd.openvino.generate_args import PRECISIONS
from xeonsd.serve.options import MAX_BODY_BYTES


def _serve(args: argparse.Namespace) -> int:
    from xeonsd.serve.server import main_args

    return main_args(args)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve an export over HTTP: the OpenAI/OVMS images API with per-request LoRA (docs/serving.md)",
        description="Serve EXPORT_DIR (written by `xeonsd export`, static shape) on POST /v3/images/generations and "
        "/v1/images/generations, with GET /v1/models, /v2/health/live, /v2/health/ready and /metrics.",
    )
    p.add_argument("export_dir", help="directory written by `xeonsd export`")
    p.add_argument(
        "--adapter",
        action="append",
        metavar="NAME=PATH[:ALPHA]",
        help="register a LoRA file under NAME (a request's model picks it; repeat for several; ALPHA default 1.0)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="one key per line, KEY or NAME:KEY: every route but /v2/health/* then needs Authorization: Bearer KEY "
        "(else 401); SIGHUP reloads the file (default: no key; a warning when --host is beyond loopback)",
    )
    p.add_argument(
        "--allow-from",
        metavar="CIDR[,CIDR...]",
        help="answer only clients in these networks (the front's address); others get 403 before any other work. "
        "Loopback is always allowed, so the node's own checks work (default: any address)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        metavar="N",
        help="the largest request body, by Content-Length or as it streams in; past it: 413 "
        f"(default {MAX_BODY_BYTES}: two 1024 px PNGs of an image edit, with room to spare)",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="the headers must arrive within this of the connection, the body within this of the headers; "
        "else 408 and the connection is closed (default 30)",
    )
    p.add_argument(
        "--rate-limit",
        type=int,
        default=0,
        metavar="N",
        help="requests per minute per API key (per client address without --api-key-file), a burst of N; past it: "
        "429 with Retry-After; the health checks and /metrics are not counted (default 0: no limit)",
    )
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    p.add_argument(
        "--workers",
        default="auto",
        metavar="N|auto",
        help="pipelines generating at once, each on its share of the cores (auto: one per core, as many as "
        "the memory holds; docs/serving.md)",
    )
    p.add_argument("--queue", type=int, default=8, help="requests that may wait for a worker; past it: 429")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS", help="cancel a request past this (504)")
    p.add_argument(
        "--drain",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="on SIGTERM, report not ready but go on answering for this long, then finish the requests in flight "
        "and stop (longer than a balancer's health check takes to see it: a rolling restart loses no request); "
        "0: cancel them and stop at once",
    )
    p.add_argument("--max-images", type=int, default=4, metavar="N", help="the largest n of a request")
    p.add_argument("--max-steps", type=int, default=100, metavar="N", help="the largest num_inference_steps")
    p.add_argument("--name", help="the base model's name in requests (default: the export directory's name)")
    p.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        default="auto",
        help="auto: OpenVINO's default (bf16 on a CPU with AMX or AVX512-BF16, f32 elsewhere); f32: always f32 "
        "(slower there; the images then match PyTorch fp32 closely), as xeonsd generate --precision",
    )
    p.add_argument(
        "--write-ovms-config",
        metavar="DIR",
        help="write an OpenVINO Model Server config (graph.pbtxt, config.json) serving the same export and "
        "adapters to DIR, and exit",
    )
    p.set_defaults(func=_serve)
