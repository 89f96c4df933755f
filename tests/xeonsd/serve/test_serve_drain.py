"""``xeonsd serve --drain``: what a rolling restart behind a balancer relies on. On SIGTERM the server reports not
ready at once (the balancer's health check takes it out of rotation), answers every request for the drain time,
the one in flight included, then stops with exit 0: no request is lost."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_process import ServeProcess, post, wait_metric

pytestmark = pytest.mark.xdist_group("xeonsd-serve")

DRAIN_S = 5  # the request sent during the drain must reach the server inside it, also on a loaded machine


def test_sigterm_drains_then_answers_what_came_in_and_exits_0(ov_base: Path, cli_env_module: dict[str, str]) -> None:
    server = ServeProcess(ov_base, "--workers=1", f"--drain={DRAIN_S}", env=cli_env_module).start()
    try:
        answers: dict = {}
        long = threading.Thread(target=post, args=(server, 40, answers, "in flight"))
        long.start()
        wait_metric(server, "xeonsd_serve_busy_workers", 1)
        server.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        ready = httpx.get(f"{server.url}/v2/health/ready")
        while ready.status_code == 200 and time.monotonic() - t0 < 1:
            ready = httpx.get(f"{server.url}/v2/health/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        post(server, 2, answers, "during the drain")  # a request the balancer sent before it saw the node leave
        long.join()
        assert answers["in flight"].status_code == 200, answers["in flight"].text
        assert answers["during the drain"].status_code == 200, answers["during the drain"].text
        assert server.proc.wait(60) == 0
        assert time.monotonic() - t0 >= DRAIN_S
        assert any("drained; stopping" in line for line in server.lines), server.lines[-10:]
    finally:
        server.stop()
