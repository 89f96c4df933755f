"""``xeonsd bench serve``: what serving costs. Throughput and p50/p95 latency of ``xeonsd serve`` at 1…N concurrent
clients, for each ``--workers`` count, against ``xeonsd generate``'s own time per image (the GenAI engine in this
process, same export, steps and seed), and what switching adapters between requests costs.

Every server is started by the bench itself on 127.0.0.1 (``--port 0``), one per ``--workers`` count, all before
the first round (an idle server costs memory, no CPU), and stopped with SIGTERM at the end: the load goes only to
loopback. Each load level is bounded in count (``--requests``) and time (``--max-seconds``). Rounds interleave
everything (generate, then each server at each client count, then the adapter switch: A B C … A B C), and the
ratios are taken within a round (xeonsd.bench.rounds): a shared machine drifts between rounds.

The adapter switch (``--adapter``, on the first server): sequential requests alternating base and adapter against
the same number of base-only requests; the switch cost is the difference of their median latencies.

``--soak``: twice the measured capacity through a front while a server is killed and an adapter rolled out
(:mod:`xeonsd.bench.soak`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xeonsd.bench import rounds as rnd
from xeonsd.bench.closed_loop import PROMPT, SERVING, load, p50_p95
from xeonsd.bench.soak_report import Target
from xeonsd.fsutil import atomic_file


@dataclass
class Server:
    workers: int
    proc: subprocess.Popen
    port: int = 0

    def post(self, body: dict[str, Any], timeout: float) -> tuple[int | str, float]:
        """One request on a new connection: (status, or ``error`` without an answer; seconds)."""
        return Target("127.0.0.1", self.port).post(body, timeout)


def start_server(export_dir: Path, workers: int, args: argparse.Namespace) -> Server:
    cmd = [sys.executable, "-m", "xeonsd.cli", "serve", str(export_dir), "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--workers", str(workers), "--queue", "1000", "--timeout", "3600", "--max-steps", str(args.steps)]
    cmd += ["--name", "base", *(f"--adapter={a}" for a in args.adapter or [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    server = Server(workers=workers, proc=proc)
    assert proc.stdout is not None
    for line in proc.stdout:  # the one line it prints, once every pipeline is compiled
        if m := SERVING.match(line.strip()):
            server.port = int(m[1])
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain the rest
            return server
    raise SystemExit(
        f"xeonsd bench serve: error: xeonsd serve --workers {workers} exited with {proc.wait()}; run "
        f"`xeonsd serve {export_dir} --workers {workers}` to see why"
    )


def stop_server(server: Server) -> int:
    server.proc.terminate()
    try:
        return server.proc.wait(60)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        return server.proc.wait()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from xeonsd.cpu import cpu_info
    from xeonsd.openvino.generate import Call, GenerateOptions, open_engine
    from xeonsd.openvino.manifest import read_manifest, static_shape

    export_dir = Path(args.export_dir)
    shape = static_shape(read_manifest(export_dir))
    if shape is None:
        raise SystemExit("xeonsd bench serve: error: the export has dynamic shapes; serve needs a static one")
    n = shape.images_per_call
    opts = GenerateOptions(prompts=(PROMPT,), num_images=n, steps=args.steps, seed=0, engine="genai")
    engine = open_engine(export_dir, opts)
    engine.run(Call(prompts=[PROMPT] * shape.batch_size, per_prompt=shape.num_images_per_prompt, seed=0), steps=1)
    servers = [start_server(export_dir, w, args) for w in args.workers]
    body = {"prompt": PROMPT, "n": n, "num_inference_steps": args.steps}
    adapter = args.adapter[0].partition("=")[0] if args.adapter else None
    generate_s: list[float] = []
    levels: dict[str, list[dict[str, Any]]] = {}
    switch: dict[str, list[float]] = {"same": [], "switching": []}
    try:
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for k in range(args.generate_calls):
                engine.run(Call(prompts=[PROMPT] * shape.batch_size, per_prompt=shape.num_images_per_prompt, seed=k))
            generate_s.append((time.perf_counter() - t0) / (args.generate_calls * n))
            for server in servers:
                for clients in args.clients:
                    key = f"{server.workers}w x {clients}c"
                    levels.setdefault(key, []).append(load(server, clients, args.requests, args.max_seconds, body))
            if adapter is not None:
                for mode in ("same", "switching"):
                    for i in range(args.switch_requests):
                        model = adapter if mode == "switching" and i % 2 else "base"
                        status, seconds = servers[0].post({**body, "model": model, "rng_seed": i}, args.max_seconds)
                        if status == 200:
                            switch[mode].append(seconds)
    finally:
        codes = [stop_server(s) for s in servers]
        engine.close()
    return _report(args, shape, generate_s, levels, switch, codes, cpu_info().model)


def _report(args, shape, generate_s, levels, switch, codes, cpu) -> dict[str, Any]:  # noqa: ANN001
    rows = []
    for key, runs in levels.items():
        lat = [x for r in runs for x in r["latencies"]]
        per_image = [r["wall_s"] / max(r["images"], 1) for r in runs]
        rows.append(
            {
                "level": key,
                "images_per_s": rnd.spread([r["images_per_s"] for r in runs]),
                **p50_p95(lat),
                "requests": len(lat),
                "failed": [f for r in runs for f in r["failed"]],
                # serving's seconds per image over generate's, within each round
                "ratio_to_generate": rnd.spread(rnd.per_round_ratios(per_image, generate_s)),
            }
        )
    out: dict[str, Any] = {
        "export": str(args.export_dir),
        "shape": shape.describe(),
        "steps": args.steps,
        "rounds": args.rounds,
        "cpu": cpu,
        "generate_s_per_image": rnd.spread(generate_s),
        "levels": rows,
        "server_exit_codes": codes,
    }
    if switch["same"] and switch["switching"]:
        same, switching = statistics.median(switch["same"]), statistics.median(switch["switching"])
        out["adapter_switch"] = {"base_only_p50_s": same, "alternating_p50_s": switching, "cost_s": switching - same}
    saturated = [r for r in rows if r["level"].endswith(f"x {max(args.clients)}c")]
    if saturated:
        best = max(saturated, key=lambda r: r["images_per_s"]["median"])
        out["best_workers"] = int(best["level"].split("w")[0])
    return out


def format_table(report: dict[str, Any]) -> str:
    g = report["generate_s_per_image"]
    lines = [
        f"xeonsd bench serve: {report['export']} ({report['shape']}), {report['steps']} steps, "
        f"{report['rounds']} round(s), CPU: {report['cpu']}",
        f"xeonsd generate (GenAI, this process): {g['median']:.3f} s/image ({rnd.range_text(g, '.3f')})",
        f"{'workers x clients':<18} {'images/s':>9} {'p50 s':>8} {'p95 s':>8} {'reqs':>5} {'s/image vs generate':>20}",
    ]
    for r in report["levels"]:
        p50 = f"{r['p50_s']:.3f}" if r["p50_s"] is not None else "-"
        p95 = f"{r['p95_s']:.3f}" if r["p95_s"] is not None else "-"
        ratio = r["ratio_to_generate"]
        fail = f"  ({len(r['failed'])} failed)" if r["failed"] else ""
        lines.append(
            f"{r['level']:<18} {r['images_per_s']['median']:>9.3f} {p50:>8} {p95:>8} {r['requests']:>5} "
            f"{ratio['median']:>19.2f}x{fail}"
        )
    if "adapter_switch" in report:
        s = report["adapter_switch"]
        lines.append(
            f"adapter switch: p50 {s['alternating_p50_s']:.3f} s alternating vs {s['base_only_p50_s']:.3f} s base "
            f"only: {s['cost_s'] * 1000:+.1f} ms per switch"
        )
    if "best_workers" in report:
        lines.append(f"best --workers here (throughput at the most clients): {report['best_workers']}")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated counts, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected counts of at least 1, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xeonsd bench serve", description=__doc__.splitlines()[0])
    p.add_argument("export_dir", help="directory written by `xeonsd export` (static shape)")
    p.add_argument("--adapter", action="append", metavar="NAME=PATH[:ALPHA]", help="also measure switching to it")
    p.add_argument("--workers", type=_ints, help="server --workers counts (default 1,2; --soak: one count, 1)")
    p.add_argument("--clients", type=_ints, default=[1, 2, 4], help="concurrent clients (default 1,2,4)")
    p.add_argument("--requests", type=int, default=8, help="requests per load level and round (default 8)")
    p.add_argument("--max-seconds", type=float, default=120.0, help="time bound of one load level (default 120)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--generate-calls", type=int, default=2, help="timed generate calls per round (default 2)")
    p.add_argument("--switch-requests", type=int, default=8, help="requests per adapter-switch sequence")
    p.add_argument("--out", "--json", dest="out", metavar="FILE", help="write the report as JSON here too")
    _add_soak_flags(p.add_argument_group("--soak (xeonsd.bench.soak)"))
    return p


def _add_soak_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--soak", action="store_true", help="a soak under faults through a front, instead of the rounds")
    g.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    g.add_argument("--max-requests", type=int, default=100_000, help="the most requests sent (default 100000)")
    g.add_argument("--servers", type=int, default=2, help="local xeonsd serve processes (default 2)")
    g.add_argument("--overload", type=float, default=2.0, help="offered rate over the capacity (default 2)")
    g.add_argument("--max-in-flight", type=int, default=64, help="unanswered requests at most (default 64)")
    g.add_argument("--capacity-requests", type=int, default=24, help="requests of the capacity's loop (default 24)")
    g.add_argument("--capacity-clients", type=int, help="its clients (default 2 per worker)")
    g.add_argument("--queue", type=int, default=8, help="each server's --queue (default 8)")
    g.add_argument("--drain", type=float, default=5.0, help="each server's --drain seconds (default 5)")
    g.add_argument("--request-timeout", type=float, default=120.0, help="each server's --timeout (default 120)")
    g.add_argument("--rss-bound", type=float, default=10.0, help="allowed RSS growth, %% (default 10)")
    g.add_argument("--fd-bound", type=int, default=16, help="allowed growth of open descriptors (default 16)")
    g.add_argument("--seed", type=int, default=0, help="of the arrival times (default 0)")
    g.add_argument("--front", metavar="URL", help="an existing front (http(s)://, loopback or 10.231.0.0/16)")
    g.add_argument("--cacert", help="--front https://: the CA that signed its certificate")
    g.add_argument("--api-key-file", help="--front: its key file (the first key is sent)")
    for what in ("kill", "restart", "roll"):
        g.add_argument(f"--{what}-cmd", metavar="CMD", help=f"--front: the command that does the {what}")


def soak_main(args: argparse.Namespace) -> int:
    from xeonsd.bench import soak, soak_report

    args.workers = args.workers or [1]
    if len(args.workers) != 1:
        raise SystemExit("xeonsd bench serve: error: --soak takes one --workers count")
    counts = (args.max_requests, args.servers, args.max_in_flight, args.capacity_requests, args.steps, args.queue)
    if min(counts) < 1 or args.duration <= 0 or args.overload <= 0 or args.request_timeout <= 0:
        raise SystemExit("xeonsd bench serve: error: --soak's counts must be at least 1 and its times positive")
    if args.drain < 0:
        raise SystemExit("xeonsd bench serve: error: --drain must be 0 or more seconds")
    try:
        report = soak.run_soak(args)
    except soak_report.SoakError as exc:
        raise SystemExit(f"xeonsd bench serve --soak: error: {exc}") from None
    _print_and_write(report, soak_report.format_report(report), args.out)
    return 0 if report["statuses"]["met"] and report["memory_met"] is not False else 1


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.soak:
        return soak_main(args)
    args.workers = args.workers or [1, 2]
    if min(args.requests, args.steps, args.rounds, args.generate_calls, args.switch_requests) < 1:
        raise SystemExit("xeonsd bench serve: error: counts must be at least 1")
    if args.max_seconds <= 0:
        raise SystemExit("xeonsd bench serve: error: --max-seconds must be positive")
    report = run(args)
    _print_and_write(report, format_table(report), args.out)
    return 0 if all(c == 0 for c in report["server_exit_codes"]) else 1


def _print_and_write(report: dict[str, Any], table: str, out: str | None) -> None:
    """Print the table; with ``--out``, write the report and its table as JSON there too."""
    print(table)
    if out:
        with atomic_file(Path(out), "w") as fh:
            json.dump({**report, "table": table}, fh, indent=2)
        print(f"results: {out}")
