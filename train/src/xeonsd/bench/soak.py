"""``xeonsd bench serve --soak``: twice the measured capacity through a front, for ``--duration`` seconds, while
one server is killed and an adapter is rolled out; what was answered, how fast, and whether the servers grew.

Locally (the default) it starts ``--servers`` ``xeonsd serve`` processes on loopback ports (``--drain``, as
serve.yml runs them) behind an HAProxy of its own on loopback, configured as roles/serve_frontend's template
balances and checks (leastconn, ``/v2/health/ready`` every second, retries on a refused connection, an empty
answer or 503). With ``--front URL`` it loads an existing front (the test cluster's; ``https://`` with
``--cacert``; a key from ``--api-key-file``); the kill, the restart and the roll are then the commands
``--kill-cmd``, ``--restart-cmd`` and ``--roll-cmd`` (skipped, with a note, when not given), and the servers'
memory is not measured. Only loopback and the test cluster's network (10.231.0.0/16) are accepted as targets.

1. Capacity: the bench's closed loop (``--capacity-requests`` requests from 2 clients per worker), images/s.
2. Load: Poisson arrivals at ``--overload`` (2) times that many requests per second, each sent whatever the others
   are doing (open loop), at most ``--max-requests``, for ``--duration`` s; at most ``--max-in-flight`` unanswered
   (an arrival past that is not sent and is counted).
3. At a third of the duration server 0 gets SIGKILL and is restarted; the failures that end while it is down
   (until the front has it back) may be at most the requests it had in flight (HAProxy's count for it).
4. At two thirds the servers are restarted one at a time with ``--adapter NAME=PATH`` added (SIGTERM, the drain,
   start, wait until back in the front), as serve.yml's roll does; then every other request asks for the adapter.
5. Each server process's RSS (VmRSS) and open descriptors (/proc/PID/fd), sampled every second: its first sample
   after a warm-up against its last, within ``--rss-bound`` % and ``--fd-bound`` descriptors.

It prints the report (and writes it as JSON with ``--json FILE``); no figure is asserted: the exit status is 0
when the statuses and the memory bounds were met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xeonsd.bench import soak_report as sr
from xeonsd.bench.closed_loop import PROMPT, SERVING, load

log = logging.getLogger(__name__)
START_S = 300.0  # a server's start (import, compile) on a loaded machine
BACKEND = "xeonsd_serve"
HAPROXY = """global
    maxconn 1024
defaults
    mode http
    timeout connect 2s
    timeout client {timeout}s
    timeout server {timeout}s
    timeout http-request 30s
    option http-buffer-request
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response 503
frontend xeonsd_serve_front
    bind 127.0.0.1:{front}
    default_backend {backend}
backend {backend}
    balance leastconn
    option httpchk GET /v2/health/ready
    http-check expect status 200
    # A killed server refuses the check's connection at once (out after 2 checks); a live one whose CPUs are busy
    # generating may answer the check late, which must not take it out: 5 s per check, not the interval's 1 s.
    timeout check 5s
    default-server inter 1s fall 2 rise 1
{servers}
listen xeonsd_serve_stats
    bind 127.0.0.1:{stats}
    stats enable
    stats uri /stats
"""


@dataclass
class Life:
    """One server process: a slot's processes follow each other on the slot's port."""

    server: int
    proc: subprocess.Popen
    started_s: float
    serving: threading.Event = field(default_factory=threading.Event)
    in_rotation_s: float | None = None
    ended: str = "running"
    stopping: bool = False  # signalled: no more samples (a draining process closes its sockets, frees memory)
    ended_s: float | None = None
    samples: list[dict[str, Any]] = field(default_factory=list)


class LocalFleet:
    """``--servers`` local ``xeonsd serve`` processes behind a local HAProxy, all on loopback."""

    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args, self.workdir = args, workdir
        self.ports = [sr.free_port() for _ in range(args.servers)]
        self.front_port, self.stats_port = sr.free_port(), sr.free_port()
        self.lives: list[Life] = []
        self.current: list[Life] = []
        self.haproxy: subprocess.Popen | None = None
        self.sampling = threading.Lock()
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _spawn(self, i: int, adapter: str | None) -> Life:
        a = self.args
        cmd = [sys.executable, "-m", "xeonsd.cli", "serve", str(a.export_dir), "--host", "127.0.0.1"]
        cmd += ["--port", str(self.ports[i]), "--workers", str(a.workers[0]), "--queue", str(a.queue)]
        cmd += ["--timeout", str(a.request_timeout), "--max-steps", str(a.steps), "--drain", str(a.drain)]
        cmd += ["--name", "base", *([f"--adapter={adapter}"] if adapter else [])]
        log = open(self.workdir / f"server{i}.log", "a")  # noqa: SIM115 - the process writes it; closed below
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        log.close()
        life = Life(server=i, proc=proc, started_s=self.now())

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if SERVING.match(line.strip()):
                    life.serving.set()

        threading.Thread(target=read, daemon=True).start()
        self.lives.append(life)
        if len(self.current) > i:
            self.current[i] = life
        else:
            self.current.append(life)
        return life

    def _wait_serving(self, life: Life, watch: dict[str, bool] | None = None) -> None:
        deadline = time.monotonic() + START_S
        while not life.serving.wait(0.2):
            if watch is not None and self.state(life.server).startswith("DOWN"):
                watch["seen_down"] = True
            if life.proc.poll() is not None or time.monotonic() > deadline:
                raise sr.SoakError(
                    f"xeonsd serve (server {life.server}) did not start (exit {life.proc.poll()}); its log: "
                    f"{self.workdir / f'server{life.server}.log'}:\n{self._tail(life.server)}"
                )

    def _tail(self, i: int) -> str:
        lines = (self.workdir / f"server{i}.log").read_text(errors="replace").splitlines()
        return "\n".join(line for line in lines if not line.startswith("{"))[-3000:]

    def start(self) -> None:
        haproxy = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
        if haproxy is None:
            raise sr.SoakError("haproxy is not installed (apt-get install haproxy), or give --front URL")
        for i in range(self.args.servers):
            self._spawn(i, None)
        servers = "\n".join(f"    server s{i} 127.0.0.1:{p} check" for i, p in enumerate(self.ports))
        cfg = self.workdir / "haproxy.cfg"
        timeout = int(self.args.request_timeout) + 10
        cfg.write_text(
            HAPROXY.format(
                timeout=timeout, front=self.front_port, stats=self.stats_port, backend=BACKEND, servers=servers
            )
        )
        check = subprocess.run([haproxy, "-c", "-f", str(cfg)], capture_output=True, text=True)
        if check.returncode != 0:
            raise sr.SoakError(f"haproxy refused {cfg}: {check.stdout}{check.stderr}")
        with open(self.workdir / "haproxy.log", "w") as log:
            self.haproxy = subprocess.Popen([haproxy, "-db", "-f", str(cfg)], stdout=log, stderr=log)
        for life in self.current:
            self._wait_serving(life)
            self._wait_up(life)

    def stats(self) -> dict[str, dict[str, str]]:
        """HAProxy's statistics of the backend's servers (s0, s1, …), or {} while it does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5) as answer:
                text = answer.read().decode().lstrip("# ")
        except OSError:
            return {}
        rows = csv.DictReader(io.StringIO(text))
        return {r["svname"]: r for r in rows if r["pxname"] == BACKEND and r["svname"].startswith("s")}

    def state(self, i: int) -> str:
        return self.stats().get(f"s{i}", {}).get("status", "")

    def _wait_up(self, life: Life) -> None:
        deadline = time.monotonic() + 60
        while not self.state(life.server).startswith("UP"):
            if time.monotonic() > deadline:
                raise sr.SoakError(f"HAProxy never had server {life.server} back UP; see {self.workdir}")
            time.sleep(0.1)
        life.in_rotation_s = self.now()

    def kill(self, i: int) -> dict[str, Any]:
        """SIGKILL server i, restart it, wait until the front has it back."""
        old = self.current[i]
        in_flight = int(self.stats().get(f"s{i}", {}).get("scur") or 0)
        at = self.now()
        self.sample(last=old)
        old.proc.send_signal(signal.SIGKILL)
        old.proc.wait()
        old.ended, old.ended_s = "SIGKILL", self.now()
        watch = {"seen_down": False}
        life = self._spawn(i, None)
        try:
            self._wait_serving(life, watch)
            watch["seen_down"] = watch["seen_down"] or self.state(i).startswith("DOWN")
            self._wait_up(life)
        except sr.SoakError as exc:  # reported: the run goes on with the other servers
            log.error("%s", exc)
        back, seen = life.in_rotation_s, watch["seen_down"]
        return {
            "server": i,
            "at_s": at,
            "in_flight": in_flight,
            "seen_down": seen,
            "back_s": back,
            "recovered": bool(back),
        }

    def roll(self, adapter: str) -> list[dict[str, Any]]:
        """serve.yml's roll: one server at a time, SIGTERM (it drains), then again with the adapter."""
        done = []
        for i in range(len(self.current)):
            old = self.current[i]
            stop_s = self.now()
            self.sample(last=old)
            old.proc.terminate()
            rc = old.proc.wait(self.args.drain + self.args.request_timeout + 30)
            old.ended, old.ended_s = f"SIGTERM, exit {rc}", self.now()
            life = self._spawn(i, adapter)
            self._wait_serving(life)
            self._wait_up(life)
            done.append({"server": i, "stop_s": stop_s, "exit": rc, "back_s": life.in_rotation_s})
        return done

    def sample(self, last: Life | None = None) -> None:
        """A sample of every running process; with ``last``, only of that one, about to be signalled: its last."""
        with self.sampling:
            for life in self.lives if last is None else [last]:
                if not life.stopping and (f := sr.figures(life.proc.pid)) is not None:
                    life.samples.append({"t_s": self.now(), **f})
            if last is not None:
                last.stopping = True

    def close(self) -> list[int]:
        for life in self.current:
            self.sample(last=life)
            with contextlib.suppress(ProcessLookupError):
                life.proc.terminate()
        codes = []
        for life in self.current:
            try:
                codes.append(life.proc.wait(self.args.drain + 30))
            except subprocess.TimeoutExpired:
                life.proc.kill()
                codes.append(life.proc.wait())
            if life.ended == "running":
                life.ended, life.ended_s = f"SIGTERM at the end, exit {codes[-1]}", self.now()
        if self.haproxy is not None:
            self.haproxy.terminate()
            self.haproxy.wait(30)
        return codes


def capacity(target: sr.Target, args: argparse.Namespace) -> dict[str, Any]:
    """The bench's closed loop through the front: requests and images per second at saturation."""
    clients = args.capacity_clients or 2 * args.servers * args.workers[0]
    body = {"prompt": PROMPT, "num_inference_steps": args.steps}
    run = load(target, clients, args.capacity_requests, args.request_timeout, body)
    if not run["latencies"]:
        raise sr.SoakError(f"measuring the capacity: no request was answered 200 (statuses: {run['failed']})")
    n = len(run["latencies"])
    return {"clients": clients, "requests": n, "requests_per_s": n / run["wall_s"], "images_per_s": run["images_per_s"]}


def _kill(fleet: LocalFleet | None, args: argparse.Namespace, t0: float) -> dict[str, Any]:
    if fleet is not None:
        return fleet.kill(0)
    kill = sr.command("kill", args.kill_cmd, t0)
    if "skipped" not in kill:
        restart = sr.command("restart", args.restart_cmd, t0)
        kill.update(server=0, seen_down=None, in_flight=None, back_s=restart.get("done_s"))
        kill["recovered"] = "skipped" not in restart
    return kill


def _roll(fleet: LocalFleet | None, args: argparse.Namespace, t0: float, start: float) -> dict[str, Any]:
    adapter = args.adapter[0] if args.adapter else None
    roll: dict[str, Any] = {"adapter": adapter and adapter.partition("=")[0]}
    if adapter is None:
        return {**roll, "skipped": "no --adapter NAME=PATH to roll out"}
    if time.monotonic() - start >= args.duration:
        return {**roll, "skipped": "the load had ended when the kill's restart was done; a longer --duration rolls out"}
    roll["start_s"] = time.monotonic() - t0
    if fleet is not None:
        roll["servers"] = fleet.roll(adapter)
    else:
        roll.update(sr.command("roll", args.roll_cmd, t0))
    roll["done_s"] = time.monotonic() - t0
    return roll


def _load_with_faults(target: sr.Target, fleet: LocalFleet | None, args: argparse.Namespace, rate: float) -> dict:
    """The open loop in a thread; meanwhile the kill at 1/3, the roll at 2/3, and the samples every second."""
    name = args.adapter[0].partition("=")[0] if args.adapter else None
    rolled, stop = threading.Event(), threading.Event()

    def send(i: int) -> tuple[int | str, float, str]:
        model = name if name and rolled.is_set() and i % 2 else "base"
        body = {"prompt": PROMPT, "num_inference_steps": args.steps, "rng_seed": i}
        status, seconds = target.post({**body, **({"model": model} if model != "base" else {})}, 3600)
        return status, seconds, model

    def sampler() -> None:
        while fleet is not None and not stop.wait(1.0):
            fleet.sample()

    out: dict[str, Any] = {}
    start = time.monotonic()
    t0 = fleet.t0 if fleet else start

    def loop() -> None:
        a = args
        out["records"], out["shed"] = sr.open_loop(
            send, rate, a.duration, a.max_requests, a.max_in_flight, a.seed, start
        )

    sent = threading.Thread(target=loop)
    sent.start()
    threading.Thread(target=sampler, daemon=True).start()
    try:
        time.sleep(max(0.0, start + args.duration / 3 - time.monotonic()))
        out["kill"] = _kill(fleet, args, t0)
        time.sleep(max(0.0, start + 2 * args.duration / 3 - time.monotonic()))
        out["roll"] = _roll(fleet, args, t0, start)
        if "skipped" not in out["roll"]:
            rolled.set()
    finally:
        sent.join()
        stop.set()
    if fleet is not None:
        fleet.sample()
    shift = start - t0  # the loop's times are since its start; the faults' since the fleet's
    out["records"] = [sr.Record(r.sent_s + shift, r.done_s + shift, r.status, r.model) for r in out["records"]]
    out["load_start_s"] = shift
    return out


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    key = Path(args.api_key_file).read_text().split()[0].rpartition(":")[2] if args.api_key_file else None
    target = sr.Target.from_url(args.front, key, args.cacert) if args.front else sr.Target("127.0.0.1", 0)
    loadavg = [os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="xeonsd-soak-") as tmp:
        fleet = None if args.front else LocalFleet(args, Path(tmp))
        codes: list[int] = []
        try:
            if fleet is not None:
                fleet.start()
                target = sr.Target("127.0.0.1", fleet.front_port)
            cap = capacity(target, args)
            rate = args.overload * cap["requests_per_s"]
            out = _load_with_faults(target, fleet, args, rate)
        finally:
            if fleet is not None:
                codes = fleet.close()
    loadavg.append(os.getloadavg())
    lives, now = (fleet.lives, fleet.now()) if fleet else ([], 0.0)
    return sr.assemble(args, target.url, cap, rate, out, codes, lives, now, loadavg)
