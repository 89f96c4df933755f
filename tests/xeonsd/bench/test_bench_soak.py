"""``xeonsd bench serve --soak``: its address guard, its open loop and status accounting, and a mini-soak of two
real servers behind a real HAProxy on the tiny export, one of them killed and restarted. (The 10-minute soak's
figures: docs/benchmarks.md.)"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from xeonsd.bench import serve as bench
from xeonsd.bench import soak_report as sr


def test_the_guard_lets_through_only_loopback_and_the_test_cluster() -> None:
    assert sr.guard_host("127.0.0.1") == "127.0.0.1"
    assert sr.guard_host("localhost").startswith("127.")
    assert sr.guard_host("10.231.0.12") == "10.231.0.12"
    for outside in ("10.230.0.1", "192.168.1.10", "8.8.8.8"):
        with pytest.raises(sr.SoakError, match=f"{outside} is outside loopback"):
            sr.guard_host(outside)
    with pytest.raises(sr.SoakError, match="expected http://HOST:PORT"):
        sr.Target.from_url("ftp://127.0.0.1:8443")
    assert sr.Target.from_url("https://localhost:8443", cafile="ca.pem").url == "https://localhost:8443"
    with pytest.raises(sr.SoakError, match="is outside loopback"):
        sr.Target.from_url("http://172.16.0.1:8000")
    assert sr.Target.from_url("http://127.0.0.1:8123").url == "http://127.0.0.1:8123"


def test_only_failures_while_the_node_was_down_and_no_more_than_its_in_flight_are_allowed() -> None:
    ok = [sr.Record(0.0, 1.0, "200", "base"), sr.Record(0.5, 1.0, "429", "base")]
    down = [sr.Record(9.0, 10.5, "502", "base"), sr.Record(9.5, 10.2, sr.ERROR, "base")]
    late = [sr.Record(30.0, 31.0, "500", "base")]
    met = sr.account(ok + down, down=(10.0, 20.0), allowance=2)
    assert (
        met["met"] and met["failed_while_down"] == 2 and met["by_status"] == {"200": 1, "429": 1, "502": 1, "error": 1}
    )
    assert met["failed_while_down_sent_after_kill"] == 0
    assert not sr.account(ok + down, down=(10.0, 20.0), allowance=1)["met"]  # more than were in flight
    after = sr.account([*down, sr.Record(11.0, 12.0, "503", "base")], down=(10.0, 20.0), allowance=2)
    assert not after["met"] and after["failed_while_down_sent_after_kill"] == 1
    outside = sr.account(ok + down + late, down=(10.0, 20.0), allowance=2)
    assert not outside["met"] and outside["unexpected_failures"] == {"500": 1}
    assert not sr.account(ok + down, down=None, allowance=0)["met"]  # no kill: no failure allowed
    assert sr.latencies(ok)["count"] == 1 and sr.latencies(ok)["p50_s"] == 1.0


def test_growth_is_judged_against_the_stated_bounds() -> None:
    first = {"rss_kib": 1000, "fds": 20}
    assert sr.growth(first, {"rss_kib": 1099, "fds": 36}, 10.0, 16)["met"]
    assert not sr.growth(first, {"rss_kib": 1101, "fds": 20}, 10.0, 16)["met"]
    assert not sr.growth(first, {"rss_kib": 1000, "fds": 37}, 10.0, 16)["met"]


class FakeFront(ThreadingHTTPServer):
    """A stand-in front for the open-loop tests. They send bursts that overflowed http.server's default backlog of 5
    on a loaded 2-core machine: a connection reset, counted as an unanswered request (CI of 2026-12-07). A real front
    (HAProxy) queues far more."""

    request_queue_size = 256


def test_the_open_loop_sends_on_schedule_whatever_the_answers_take() -> None:
    class Slow(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server API
            self.rfile.read(int(self.headers["Content-Length"]))
            time.sleep(1.0)
            self.send_response(429)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    httpd = FakeFront(("127.0.0.1", 0), Slow)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    target = sr.Target("127.0.0.1", httpd.server_address[1])

    def send(i: int) -> tuple[int | str, float, str]:
        return (*target.post({"prompt": "p"}, 10), "base")

    try:
        t0 = time.monotonic()
        records, shed = sr.open_loop(send, rate=40.0, duration=1.0, max_requests=1000, max_in_flight=1000)
        wall = time.monotonic() - t0
        bounded, shed_bounded = sr.open_loop(send, rate=40.0, duration=1.0, max_requests=1000, max_in_flight=5)
        counted, _ = sr.open_loop(send, rate=40.0, duration=1.0, max_requests=3, max_in_flight=1000)
    finally:
        httpd.shutdown()
    # a closed loop would have sent one request a second; the open loop sends at the rate, answered or not
    assert len(records) > 15 and shed == 0 and wall < 3.5
    assert {r.status for r in records} == {"429"} and max(r.sent_s for r in records) < 1.0
    assert len(bounded) == 5 and shed_bounded > 5  # past the bound an arrival is counted, not sent
    assert len(counted) == 3


@pytest.mark.xdist_group("xeonsd-serve")  # beside the serve tests: the tiny export is made once
def test_a_mini_soak_answers_200_or_429_and_sees_the_killed_server_come_back(ov_base: Path, tmp_path: Path) -> None:  # noqa: F811
    if shutil.which("haproxy", path=f"{os.environ.get('PATH', '')}:/usr/sbin") is None and not os.environ.get("CI"):
        pytest.skip("haproxy is not installed (apt-get install haproxy)")
    out = tmp_path / "soak.json"
    argv = [str(ov_base), "--soak", "--duration", "20", "--steps", "2", "--capacity-requests", "6", "--drain", "2"]
    rc = bench.main([*argv, "--json", str(out)])
    report = json.loads(out.read_text())
    statuses, kill = report["statuses"], report["kill"]
    assert statuses["by_status"].get("200", 0) > 0 and statuses["sent"] == sum(statuses["by_status"].values())
    assert set(statuses["by_status"]) <= {"200", "429", *statuses["failed_while_down_by_status"]}
    # failures only while the node was down; whether they stayed within its in-flight count is the run's verdict,
    # printed, not asserted (HAProxy sends requests to it until its check fails: docs/benchmarks.md, the soak)
    assert not statuses["unexpected_failures"] and statuses["failed_while_down"] == sum(
        statuses["failed_while_down_by_status"].values()
    )
    assert kill["server"] == 0 and kill["seen_down"] and kill["recovered"] and kill["back_s"] > kill["at_s"]
    assert report["roll"]["skipped"] == "no --adapter NAME=PATH to roll out"
    killed, other = report["processes"][0], report["processes"][1]
    assert killed["ended"] == "SIGKILL" and other["server"] == 1
    for process in (killed, other):
        assert process["first"]["rss_kib"] > 10_000 and process["first"]["fds"] > 3 and process["last"] is not None
    assert report["server_exit_codes"] == [0, 0] and rc == (0 if statuses["met"] and report["memory_met"] else 1)
    assert "failures while it was down" in report["table"] and "RSS" in report["table"]


def test_against_a_given_front_without_commands_the_faults_are_skipped_and_said(tmp_path: Path) -> None:
    class Quick(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server API
            self.rfile.read(int(self.headers["Content-Length"]))
            time.sleep(0.05)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    httpd = FakeFront(("127.0.0.1", 0), Quick)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    out = tmp_path / "soak.json"
    front = f"http://localhost:{httpd.server_address[1]}"
    try:
        argv = ["ov", "--soak", "--front", front, "--duration", "3", "--capacity-requests", "8", "--json", str(out)]
        rc = bench.main(argv)
    finally:
        httpd.shutdown()
    report = json.loads(out.read_text())
    assert rc == 0 and report["mode"] == "front" and report["front"] == f"http://127.0.0.1:{httpd.server_address[1]}"
    assert report["capacity"]["requests"] == 8 and report["statuses"]["by_status"] == {
        "200": report["statuses"]["sent"]
    }
    assert report["statuses"]["sent"] > 3 * report["capacity"]["requests_per_s"]  # ~2x capacity for 3 s
    assert "no --kill-cmd" in report["kill"]["skipped"] and "no --adapter" in report["roll"]["skipped"]
    assert report["memory_met"] is None and any("only for the soak's own local servers" in n for n in report["notes"])
    assert "memory bounds not measured" in report["table"] and "NOT met" not in report["table"]
    with pytest.raises(SystemExit, match="outside loopback"):
        bench.main(["ov", "--soak", "--front", "http://10.0.0.1:8000", "--duration", "3"])
