"""``xeonsd serve`` over real HTTP: one server on the tiny export (static batch 5 at 64 px) with one adapter, one
worker and a queue of one, shared by the module's tests in file order (the last one stops it with SIGTERM).

The OpenAI client's round trip, the adapter and the seed, health before and after the compile, 429 under a full
queue, the timeout and the client disconnect cancelling through GenAI's step callback, each bad input refused by
name, and the metrics that count them. Images are compared as uint8 pixels: "mean" is the mean absolute
difference over all pixels.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from serve_process import PROMPT, ServeProcess, metric, post, wait_metric

pytestmark = pytest.mark.xdist_group("xeonsd-serve")  # one server, its tests in order, on one worker

SIZE = 64
PER_CALL = 5
TIMEOUT_S = 3  # --timeout: the 3-step requests take a fraction of it, the LONG ones many times it (1000 tiny steps
# took under 6 s on an idle 2-core Zen 4)
LONG = 1000  # steps of a request that runs until it is cancelled (--max-steps allows it)


@pytest.fixture(scope="module")
def server(ov_base: Path, toy_adapter: Path, cli_env_module: dict[str, str]) -> Iterator[ServeProcess]:
    with ServeProcess.running(
        ov_base,
        "--name=base",
        f"--adapter=toy={toy_adapter}",
        "--workers=1",
        "--queue=1",
        f"--timeout={TIMEOUT_S}",
        f"--max-steps={LONG}",
        f"--max-images={PER_CALL}",
        env=cli_env_module,
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServeProcess):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v3", api_key="unused", max_retries=0)


def _decode(b64: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.float64)


def _generate(client, seed: int, model: str | None = None, n: int = 1) -> list[np.ndarray]:
    kwargs = {} if model is None else {"model": model}
    result = client.images.generate(
        prompt=PROMPT, n=n, size=f"{SIZE}x{SIZE}", extra_body={"rng_seed": seed, "num_inference_steps": 3}, **kwargs
    )
    return [_decode(item.b64_json) for item in result.data]


def test_ready_only_once_every_pipeline_is_compiled(server: ServeProcess) -> None:
    """Listening first (live, not ready: 503), ready (200) once compiled, and only then the 'serving on' line."""
    assert server.ready_statuses[0] == 503 and server.ready_statuses[-1] == 200, server.ready_statuses
    assert httpx.get(f"{server.url}/v2/health/live").status_code == 200
    serving = [i for i, line in enumerate(server.lines) if line == f"serving on {server.url}"]
    compiled = [i for i, line in enumerate(server.lines) if "worker 1/1 compiled" in line]
    assert serving and compiled and compiled[0] < serving[0], server.lines


def test_openai_client_round_trip_returns_images_of_the_export_size(client) -> None:
    images = _generate(client, seed=1, n=2)
    assert [img.shape for img in images] == [(SIZE, SIZE, 3)] * 2
    assert np.abs(images[0] - images[1]).mean() > 1.0  # two images of one call, not one image twice


def test_the_seed_makes_the_image_reproducible(client) -> None:
    first, again, other = (_generate(client, seed)[0] for seed in (7, 7, 8))
    assert np.array_equal(first, again)
    assert np.abs(first - other).mean() > 5.0


def test_model_picks_the_adapter_and_switching_back_gives_the_base_image(client) -> None:
    base = _generate(client, seed=3)[0]
    toy = _generate(client, seed=3, model="toy")[0]
    assert np.abs(toy - base).mean() > 5.0
    assert np.array_equal(_generate(client, seed=3, model="base")[0], base)


def test_models_lists_the_base_and_its_adapters(client) -> None:
    assert [m.id for m in client.models.list().data] == ["base", "toy"]


BAD = [  # (body, status, the field the error names, words of its message)
    ({"prompt": PROMPT, "size": "512x512"}, 400, "size", "64x64"),
    ({"prompt": PROMPT, "n": PER_CALL + 1}, 400, "n", f"1..{PER_CALL}"),
    ({"prompt": PROMPT, "model": "nope"}, 404, "model", "known models: base, toy"),
    ({"prompt": PROMPT, "num_inference_steps": -1}, 400, "num_inference_steps", f"1..{LONG}"),
    ({"prompt": PROMPT, "num_inference_steps": 10**9}, 400, "num_inference_steps", f"1..{LONG}"),
    ({"prompt": PROMPT, "rng_seed": -1}, 400, "rng_seed", "0..4294967295"),
    ({"prompt": PROMPT, "rng_seed": 2**32}, 400, "rng_seed", "0..4294967295"),
    ({"prompt": ""}, 400, "prompt", "must not be empty"),
    ({"prompt": "   "}, 400, "prompt", "must not be empty"),
    ({"n": 1}, 400, "prompt", "required"),
    ({"prompt": PROMPT, "quality": "hd"}, 400, "quality", "unknown field"),
    (b'{"prompt": "a photo', 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "JSON object"),
]


@pytest.mark.parametrize(("body", "status", "param", "words"), BAD, ids=[str(b)[:40] for b, *_ in BAD])
def test_each_bad_input_is_refused_naming_the_field_and_counted(
    server: ServeProcess, body: dict | bytes, status: int, param: str | None, words: str
) -> None:
    label = param or "body"
    before = metric(server, "xeonsd_serve_rejected_total", param=label)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    answer = httpx.post(f"{server.url}/v1/images/generations", content=content)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert metric(server, "xeonsd_serve_rejected_total", param=label) == before + 1


def test_a_full_queue_answers_429_and_the_timeout_cancels(server: ServeProcess) -> None:
    """One worker busy with a request too long for --timeout, one request queued: the third is 429 with
    Retry-After; the long one is cancelled at the timeout (504) and the queued one then runs (200).

    --timeout counts from arrival, queue time included, so the queued request is sent half a timeout after the
    long one: it then has about half a timeout left for its 3 steps once the long one is cancelled."""
    answers: dict = {}
    before = metric(server, "xeonsd_serve_cancelled_total", reason="timeout")
    long = threading.Thread(target=post, args=(server, LONG, answers, "long"))
    sent = time.monotonic()
    long.start()
    wait_metric(server, "xeonsd_serve_busy_workers", 1)
    time.sleep(max(0.0, sent + TIMEOUT_S / 2 - time.monotonic()))
    queued = threading.Thread(target=post, args=(server, 3, answers, "queued"))
    queued.start()
    wait_metric(server, "xeonsd_serve_queue_depth", 1)
    post(server, 3, answers, "refused")
    long.join()
    queued.join()
    refused = answers["refused"]
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1, refused.text
    assert answers["long"].status_code == 504, answers["long"].text
    assert "--timeout" in answers["long"].json()["error"]["message"]
    assert answers["queued"].status_code == 200, answers["queued"].text
    assert metric(server, "xeonsd_serve_cancelled_total", reason="timeout") == before + 1
    assert metric(server, "xeonsd_serve_requests_total", endpoint="/v3/images/generations", status="429") >= 1


def test_a_client_that_goes_away_cancels_its_request(server: ServeProcess) -> None:
    before = metric(server, "xeonsd_serve_cancelled_total", reason="disconnect")
    answers: dict = {}
    post(server, LONG, answers, "gone", timeout=1.0)
    assert isinstance(answers["gone"], httpx.TimeoutException)
    wait_metric(server, "xeonsd_serve_cancelled_total", before + 1, reason="disconnect")
    wait_metric(server, "xeonsd_serve_busy_workers", 0)  # the worker is free again, long before LONG steps


def test_metrics_count_requests_images_and_steps(server: ServeProcess) -> None:
    images = metric(server, "xeonsd_serve_images_total", model="base")
    steps = metric(server, "xeonsd_serve_step_seconds_count")
    ok = metric(server, "xeonsd_serve_requests_total", endpoint="/v3/images/generations", status="200")
    answers: dict = {}
    post(server, 3, answers, "one")
    assert answers["one"].status_code == 200
    assert metric(server, "xeonsd_serve_images_total", model="base") == images + 1
    assert metric(server, "xeonsd_serve_step_seconds_count") == steps + 1
    assert metric(server, "xeonsd_serve_requests_total", endpoint="/v3/images/generations", status="200") == ok + 1


def test_sigterm_cancels_the_request_in_flight_and_exits_0(server: ServeProcess) -> None:
    """The last test: it stops the module's server. Every request left one JSON access line."""
    answers: dict = {}
    long = threading.Thread(target=post, args=(server, LONG, answers, "long"))
    long.start()
    wait_metric(server, "xeonsd_serve_busy_workers", 1)
    assert server.stop() == 0
    long.join()
    assert answers["long"].status_code == 503 and "shutting down" in answers["long"].text
    access = [json.loads(line) for line in server.lines if line.startswith("{")]
    assert {499, 429, 504, 503, 404, 400, 200} <= {a["status"] for a in access}
    assert all({"time", "client", "method", "path", "status", "seconds"} <= set(a) for a in access)
