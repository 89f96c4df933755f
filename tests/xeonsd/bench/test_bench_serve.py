"""``xeonsd bench serve``'s arithmetic: serving's time per image against generate's is taken round by round, the
best ``--workers`` is the one with the most images/s at the most clients, the adapter switch is a difference of
medians, and a load level stops at its request count. (Its figures: docs/benchmarks.md; it runs real servers.)"""

from __future__ import annotations

import argparse
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from xeonsd.bench import serve as bench
from xeonsd.openvino.manifest import StaticShape


def _run(wall: float, images: int, latencies: list[float]) -> dict:
    return {"wall_s": wall, "images": images, "images_per_s": images / wall, "latencies": latencies, "failed": []}


def test_report_compares_within_rounds_and_picks_the_best_workers() -> None:
    args = argparse.Namespace(export_dir="ov", steps=20, rounds=2, clients=[1, 4])
    shape = StaticShape(batch_size=1, height=64, width=64, num_images_per_prompt=1)
    levels = {
        "1w x 1c": [_run(4.0, 4, [1.0] * 4), _run(8.0, 4, [2.0] * 4)],  # 1.0 then 2.0 s/image
        "1w x 4c": [_run(2.0, 4, [2.0] * 4), _run(4.0, 4, [4.0] * 4)],
        "2w x 4c": [_run(1.0, 4, [1.0] * 4), _run(2.0, 4, [2.0] * 4)],
    }
    generate_s = [1.0, 2.0]  # the machine got twice as slow in round 2: the per-round ratio does not move
    switch = {"same": [0.2, 0.2, 0.3], "switching": [0.25, 0.3, 0.35]}
    report = bench._report(args, shape, generate_s, levels, switch, [0, 0], "cpu")
    rows = {r["level"]: r for r in report["levels"]}
    assert rows["1w x 1c"]["ratio_to_generate"]["min"] == rows["1w x 1c"]["ratio_to_generate"]["max"] == 1.0
    assert rows["2w x 4c"]["ratio_to_generate"]["median"] == 0.25
    assert rows["1w x 4c"]["p50_s"] == 3.0 and rows["1w x 4c"]["p95_s"] == 4.0
    assert report["best_workers"] == 2
    assert report["adapter_switch"]["cost_s"] == pytest.approx(0.1)
    table = bench.format_table(report)
    assert "best --workers here (throughput at the most clients): 2" in table and "+100.0 ms per switch" in table


def test_a_load_level_is_bounded_by_its_request_count() -> None:
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server API
            seen.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        server = bench.Server(workers=1, proc=None, port=httpd.server_address[1])  # type: ignore[arg-type]
        result = bench.load(server, clients=3, requests=7, max_seconds=30, body={"prompt": "p", "n": 2})
    finally:
        httpd.shutdown()
    assert len(seen) == len(result["latencies"]) == 7 and result["images"] == 14


def test_counts_are_parsed_and_refused_by_name() -> None:
    assert bench._ints("1,2,4") == [1, 2, 4]
    for bad in ("0,1", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            bench._ints(bad)
