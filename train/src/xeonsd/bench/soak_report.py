"""The soak's pieces around its servers (:mod:`xeonsd.bench.soak`): the address guard, the HTTP target, the front's
configuration, a process's figures, the open-loop load, the status accounting, the memory bounds and the report.

Statuses: 200 and 429 (the queue bound doing its job) are answers. Anything else (another status, or a transport
error, counted as ``error``) is a failure; failures are allowed only while the killed node was down (from its
SIGKILL until the front has it back in rotation), and at most as many as were in flight on it at the kill.
"""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import json
import os
import random
import shlex
import socket
import ssl
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from xeonsd.bench.closed_loop import p50_p95
from xeonsd.cluster.memory import resident_bytes

# The soak overloads its target on purpose: only loopback and the test cluster's network are allowed.
ALLOWED = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("10.231.0.0/16"))
ANSWERS = ("200", "429")
ERROR = "error"  # a request that got no HTTP answer (refused, reset, timed out)


class SoakError(ValueError):
    """The soak cannot run with these options."""


def guard_host(host: str) -> str:
    """The IPv4 address of ``host``; refused unless every address it resolves to is loopback or the test cluster's."""
    try:
        infos = socket.getaddrinfo(host, None, family=socket.AF_INET, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise SoakError(f"--front: cannot resolve {host!r}: {exc}") from None
    addresses = sorted({info[4][0] for info in infos})
    outside = [a for a in addresses if not any(ipaddress.ip_address(a) in net for net in ALLOWED)]
    if outside or not addresses:
        raise SoakError(
            f"--front {host}: {', '.join(outside) or 'no address'} is outside loopback (127.0.0.0/8) and the test "
            "cluster (10.231.0.0/16); the soak overloads its target on purpose, so it runs only against those"
        )
    return addresses[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def figures(pid: int) -> dict[str, int] | None:
    """A process's resident memory (KiB) and open file descriptors, or None when it is gone."""
    rss = resident_bytes(pid)
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    return None if rss is None else {"rss_kib": rss // 1024, "fds": fds}


def command(what: str, cmd: str | None, t0: float) -> dict[str, Any]:
    """A fault in front mode (``--kill-cmd`` …): run it, or say why it was skipped."""
    if not cmd:
        return {"skipped": f"no --{what}-cmd: the soak cannot reach the front's nodes"}
    at = time.monotonic() - t0
    done = subprocess.run(shlex.split(cmd), capture_output=True, text=True)
    if done.returncode != 0:
        raise SoakError(f"--{what}-cmd exited {done.returncode}: {done.stderr.strip() or done.stdout.strip()}")
    return {"at_s": at, "done_s": time.monotonic() - t0}


@dataclass(frozen=True)
class Target:
    """Where the load goes: a front's address (an IP the guard let through) and port; over TLS, the name its
    certificate is checked against (every address that name resolves to was let through) and the CA to trust."""

    host: str
    port: int
    key: str | None = None  # an API key, sent as Authorization: Bearer
    tls_name: str | None = None  # None: plain HTTP
    cafile: str | None = None

    @classmethod
    def from_url(cls, url: str, key: str | None = None, cafile: str | None = None) -> Target:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SoakError(f"--front {url!r}: expected http://HOST:PORT or https://HOST:PORT (the front's address)")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise SoakError(f"--front {url!r}: the port is not a number from 1 to 65535") from None
        tls_name = parts.hostname if parts.scheme == "https" else None
        return cls(guard_host(parts.hostname), port, key, tls_name, cafile)

    @property
    def url(self) -> str:
        return f"https://{self.tls_name}:{self.port}" if self.tls_name else f"http://{self.host}:{self.port}"

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        if self.tls_name is None:
            return http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        context = ssl.create_default_context(cafile=self.cafile)
        return http.client.HTTPSConnection(self.tls_name, self.port, timeout=timeout, context=context)

    def post(self, body: dict[str, Any], timeout: float) -> tuple[int | str, float]:
        """One image request on a new connection: (status, or ERROR without an answer; seconds)."""
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        conn = self._connection(timeout)
        t0 = time.perf_counter()
        try:
            conn.request("POST", "/v3/images/generations", json.dumps(body), headers)
            answer = conn.getresponse()
            answer.read()
            return answer.status, time.perf_counter() - t0
        except (OSError, http.client.HTTPException):
            return ERROR, time.perf_counter() - t0
        finally:
            conn.close()


@dataclass
class Record:
    sent_s: float  # since the load started
    done_s: float
    status: str
    model: str


def open_loop(
    send: Callable[[int], tuple[int | str, float, str]],
    rate: float,
    duration: float,
    max_requests: int,
    max_in_flight: int,
    seed: int = 0,
    start: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[list[Record], int]:
    """Poisson arrivals at ``rate`` per second for ``duration`` s (at most ``max_requests``), each sent in a thread
    of its own whatever the earlier ones are doing (an open loop: an overload stays an overload). An arrival that
    finds ``max_in_flight`` requests unanswered is not sent, and counted (the second value). Times are seconds
    since ``start`` (a ``clock`` reading; default: now)."""
    rng = random.Random(seed)
    lock = threading.Lock()
    records: list[Record] = []
    in_flight = threading.Semaphore(max_in_flight)
    threads: list[threading.Thread] = []
    t0 = clock() if start is None else start

    def one(i: int, sent: float) -> None:
        try:
            status, _, model = send(i)
            with lock:
                records.append(Record(sent, clock() - t0, str(status), model))
        finally:
            in_flight.release()

    shed, due, i = 0, 0.0, 0
    while i < max_requests:
        due += rng.expovariate(rate)
        if due >= duration:
            break
        time.sleep(max(0.0, due - (clock() - t0)))
        if not in_flight.acquire(blocking=False):
            shed += 1
            continue
        thread = threading.Thread(target=one, args=(i, clock() - t0), daemon=True)
        thread.start()
        threads.append(thread)
        i += 1
    for thread in threads:
        thread.join()
    return records, shed


def account(records: Sequence[Record], down: tuple[float, float] | None, allowance: int) -> dict[str, Any]:
    """Requests by status; the failures (neither 200 nor 429) that ended while the node was down (``down``: from
    the kill to back in rotation), against ``allowance`` (what was in flight on it); the others are unexpected."""
    by_status = Counter(r.status for r in records)
    failures = [r for r in records if r.status not in ANSWERS]
    while_down = [r for r in failures if down is not None and down[0] <= r.done_s <= down[1]]
    unexpected = Counter(r.status for r in failures if r not in while_down)
    return {
        "sent": len(records),
        "by_status": dict(sorted(by_status.items())),
        "failed_while_down": len(while_down),
        "failed_while_down_by_status": dict(sorted(Counter(r.status for r in while_down).items())),
        "failed_while_down_sent_after_kill": sum(r.sent_s > down[0] for r in while_down) if down else 0,
        "in_flight_at_kill": allowance,
        "unexpected_failures": dict(sorted(unexpected.items())),
        "met": not unexpected and len(while_down) <= allowance,
    }


def latencies(records: Sequence[Record], model: str | None = None) -> dict[str, float | None]:
    """p50/p95 seconds of the 200s (of one model, or all)."""
    lat = [r.done_s - r.sent_s for r in records if r.status == "200" and model in (None, r.model)]
    return {**p50_p95(lat), "count": len(lat)}


def growth(first: dict[str, int], last: dict[str, int], rss_pct: float, fds: int) -> dict[str, Any]:
    """One server process's RSS and open descriptors, first sample against last, within the stated bounds."""
    rss = 100.0 * (last["rss_kib"] - first["rss_kib"]) / max(first["rss_kib"], 1)
    more_fds = last["fds"] - first["fds"]
    return {"rss_growth_pct": round(rss, 2), "fd_growth": more_fds, "met": rss <= rss_pct and more_fds <= fds}


def processes(lives: Sequence[Any], start: float, now: float, args: Any) -> list[dict[str, Any]]:
    """Each server process (:class:`xeonsd.bench.soak.Life`): its first sample after a warm-up (from the later of
    the load's start and its own return to rotation) and its last, and their growth where both exist."""
    rows = []
    warmup = min(30.0, args.duration / 10)
    for life in lives:
        begin = max(start, life.in_rotation_s or life.started_s) + warmup
        after = [s for s in life.samples if s["t_s"] >= begin]
        first, last = (after[0], life.samples[-1]) if after else (None, None)
        judged = first is not None and last is not None and last["t_s"] - first["t_s"] >= warmup
        rows.append(
            {
                "server": life.server,
                "pid": life.proc.pid,
                "ended": life.ended,
                "lived_s": (life.ended_s or now) - life.started_s,
                "first": first,
                "last": last,
                "samples": len(life.samples),
                "growth": growth(first, last, args.rss_bound, args.fd_bound) if judged else None,  # type: ignore[arg-type]
            }
        )
    return rows


def assemble(
    args: Any,
    url: str,
    cap: dict[str, Any],
    rate: float,
    out: dict[str, Any],
    codes: list[int],
    lives: Sequence[Any],
    now: float,
    loadavg: list[tuple[float, float, float]],
) -> dict[str, Any]:
    """The report of one soak: the load's records and faults (``out``), accounted."""
    from xeonsd.cpu import cpu_info

    records, kill, notes = out["records"], out["kill"], []
    down, allowance = None, 0
    if "skipped" not in kill:
        down = (kill["at_s"], kill["back_s"] if kill.get("back_s") is not None else float("inf"))
        if kill["in_flight"] is None:  # the front's own count is not at hand: the client's, an upper bound
            kill["in_flight"] = sum(r.sent_s <= kill["at_s"] < r.done_s for r in records)
            notes.append("in flight at the kill: the client's count over every node (the front's is not at hand)")
        allowance = kill["in_flight"]
    rows = processes(lives, out["load_start_s"], now, args)
    if args.front:
        notes.append("the servers' RSS and descriptors are measured only for the soak's own local servers")
    judged = [p["growth"]["met"] for p in rows if p["growth"] is not None]
    notes.append(
        f"load average (1/5/15 min) at the start {loadavg_text(loadavg[0])}, at the end {loadavg_text(loadavg[1])}"
    )
    name = out["roll"]["adapter"]
    return {
        "mode": "front" if args.front else "local",
        "front": url,
        "servers": None if args.front else args.servers,
        "workers": args.workers[0],
        "export": str(args.export_dir),
        "steps": args.steps,
        "cpu": cpu_info().model,
        "date": datetime.date.today().isoformat(),
        "capacity": cap,
        "overload": args.overload,
        "offered_per_s": rate,
        "duration_s": args.duration,
        "max_in_flight": args.max_in_flight,
        "shed": out["shed"],
        "statuses": account(records, down, allowance),
        "latency": latencies(records),
        "adapter": name,
        "adapter_latency": latencies(records, name) if name else None,
        "kill": kill,
        "roll": out["roll"],
        "bounds": {"rss_pct": args.rss_bound, "fds": args.fd_bound},
        "processes": rows,
        "memory_met": None if args.front else bool(judged) and all(judged),
        "server_exit_codes": codes,
        "notes": notes,
    }


def format_report(r: dict[str, Any]) -> str:
    cap, st, lat = r["capacity"], r["statuses"], r["latency"]
    lines = [
        f"xeonsd bench serve --soak: {r['front']} ({r['mode']}, {r['servers']} server(s)), {r['export']}, "
        f"{r['steps']} steps, CPU: {r['cpu']}, {r['date']}",
        f"capacity (closed loop, {cap['clients']} clients, {cap['requests']} requests): "
        f"{cap['requests_per_s']:.3f} requests/s ({cap['images_per_s']:.3f} images/s)",
        f"offered: {r['offered_per_s']:.3f} requests/s ({r['overload']:g}x capacity, Poisson arrivals) for "
        f"{r['duration_s']:g} s; sent {st['sent']}, not sent (client bound {r['max_in_flight']}): {r['shed']}",
        "answered: " + ", ".join(f"{k}: {v}" for k, v in st["by_status"].items()),
        f"200s: p50 {_s(lat['p50_s'])} p95 {_s(lat['p95_s'])} ({lat['count']})"
        + (f"; adapter {r['adapter']}: {r['adapter_latency']['count']} answered" if r.get("adapter") else ""),
    ]
    kill = r["kill"]
    if kill.get("skipped"):
        lines.append(f"kill: skipped ({kill['skipped']})")
    else:
        lines.append(
            f"kill: server {kill['server']} SIGKILL at {kill['at_s']:.1f} s ({kill['in_flight']} in flight), "
            f"{ {True: 'seen DOWN', False: 'never seen DOWN', None: 'not watched'}[kill['seen_down']] } by the front, "
            + (f"back in rotation at {kill['back_s']:.1f} s" if kill["recovered"] else "NOT back in rotation")
        )
    lines.append(
        f"failures while it was down: {st['failed_while_down']} ({st['failed_while_down_sent_after_kill']} sent after "
        f"the kill; allowed: the {st['in_flight_at_kill']} in flight at it); "
        f"unexpected: {st['unexpected_failures'] or 'none'}; statuses {'met' if st['met'] else 'NOT met'}"
    )
    roll = r["roll"]
    if roll.get("skipped"):
        lines.append(f"adapter roll: skipped ({roll['skipped']})")
    else:
        lines.append(f"adapter roll ({roll['adapter']}): {roll['start_s']:.1f} s to {roll['done_s']:.1f} s")
    b = r["bounds"]
    lines.append(f"server processes (bound: RSS +{b['rss_pct']:g} %, fds +{b['fds']}, first sample vs last):")
    for p in r["processes"]:
        first, last = p["first"], p["last"]
        verdict = "" if p["growth"] is None else "met" if p["growth"]["met"] else "NOT met"
        lines.append(
            f"  server {p['server']} pid {p['pid']} ({p['ended']}, {p['lived_s']:.0f} s): RSS "
            f"{_mib(first)} -> {_mib(last)} MiB, fds {_get(first, 'fds')} -> {_get(last, 'fds')} {verdict}"
        )
    memory = {None: "not measured (no server of the soak's own)", True: "met", False: "NOT met"}[r["memory_met"]]
    lines.append(f"memory bounds {memory}")
    lines += [f"note: {n}" for n in r["notes"]]
    return "\n".join(lines)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _mib(sample: dict[str, int] | None) -> str:
    return "-" if sample is None else f"{sample['rss_kib'] / 1024:.1f}"


def _get(sample: dict[str, int] | None, key: str) -> str:
    return "-" if sample is None else str(sample[key])


def loadavg_text(values: tuple[float, float, float]) -> str:
    return "/".join(f"{v:.1f}" for v in values)
