"""The closed loop of ``xeonsd bench serve`` and of its soak: clients that send requests back to back (a saturated
server's images/s), the percentiles both report, the prompt they send and the line a ready ``xeonsd serve`` prints."""

from __future__ import annotations

import re
import statistics
import threading
import time
from typing import Any, Protocol

PROMPT = "a yellow robot at the beach, high quality"
SERVING = re.compile(r"^serving on http://127\.0\.0\.1:(\d+)$")


class Poster(Protocol):
    def post(self, body: dict[str, Any], timeout: float) -> tuple[Any, float]: ...


def load(server: Poster, clients: int, requests: int, max_seconds: float, body: dict[str, Any]) -> dict[str, Any]:
    """``clients`` threads send requests back to back until ``requests`` are sent or ``max_seconds`` pass."""
    lock = threading.Lock()
    sent = [0]
    latencies: list[float] = []
    failures: list[int] = []
    deadline = time.monotonic() + max_seconds

    def client() -> None:
        while time.monotonic() < deadline:
            with lock:
                if sent[0] >= requests:
                    return
                sent[0] += 1
            status, seconds = server.post({**body, "rng_seed": sent[0]}, timeout=max_seconds + 60)
            with lock:
                (latencies if status == 200 else failures).append(seconds if status == 200 else status)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    images = len(latencies) * body.get("n", 1)
    return {"wall_s": wall, "images": images, "images_per_s": images / wall, "latencies": latencies, "failed": failures}


def p50_p95(latencies: list[float]) -> dict[str, float | None]:
    """The median and the 95th percentile (nearest rank) of ``latencies``; None for both where there are none."""
    if not latencies:
        return {"p50_s": None, "p95_s": None}
    vals = sorted(latencies)
    return {"p50_s": statistics.median(vals), "p95_s": vals[round(0.95 * (len(vals) - 1))]}
