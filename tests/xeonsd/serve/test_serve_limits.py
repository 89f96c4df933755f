"""``xeonsd serve``'s access rule and limits on a real server (the tiny export), over real sockets: a body past
``--max-body-bytes`` is answered 413 by its Content-Length or, chunked, as soon as it passes the limit; a body or
headers slower than ``--read-timeout`` get 408 and hold no worker; ``--rate-limit`` answers 429 with Retry-After to
one key while another passes; ``--allow-from`` answers 403 to an address outside it (as root: two addresses added
to lo). Each refusal is an OpenAI error object, counted by reason in /metrics."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve_process import PROMPT, ServeProcess

from xeonsd import cli
from xeonsd.serve.limits import TokenBuckets

pytestmark = pytest.mark.xdist_group("xeonsd-serve")
LIMIT, READ_S, PER_MINUTE = 4096, 2.0, 3
KEYS = {name: f"{name}-" + "k" * 24 for name in ("body", "slow", "rate1", "rate2", "addr")}
REFUSED, OUTSIDE = "198.18.43.1", "198.18.43.2"  # RFC 2544's benchmark range, added to lo by the address test


@pytest.fixture(scope="module")
def server(ov_base: Path, tmp_path_factory: pytest.TempPathFactory, cli_env_module: dict) -> Iterator[ServeProcess]:
    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
    flags = [
        "--name=base",
        "--workers=1",
        "--host=0.0.0.0",  # the address test reaches it on an address of lo outside 127.0.0.0/8
        f"--api-key-file={key_file}",
        f"--allow-from={OUTSIDE}/32",
        f"--max-body-bytes={LIMIT}",
        f"--read-timeout={READ_S}",
        f"--rate-limit={PER_MINUTE}",
    ]
    with ServeProcess.running(ov_base, *flags, env=cli_env_module) as proc:
        proc.url = proc.url.replace("0.0.0.0", "127.0.0.1")
        yield proc


def _auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def _raw(server: ServeProcess, head: str, body: bytes = b"") -> socket.socket:
    """A connection that sends ``head`` (the request line and headers, as given) and ``body``, and no more."""
    port = int(server.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(head.encode() + body)
    return sock


def _answer(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and the seconds that took."""
    t0, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return data, time.monotonic() - t0


def _post_head(name: str, extra: str) -> str:
    return f"POST /v3/images/generations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[name]}\r\n{extra}\r\n"


def refusals(server: ServeProcess, reason: str) -> float:
    """``xeonsd_serve_refused_total{reason}`` from /metrics (which needs a key here)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", headers=_auth("body"), timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "xeonsd_serve_refused_total" and sample.labels["reason"] == reason:
                return sample.value
    return 0.0


def _healthy(server: ServeProcess) -> bool:
    return httpx.get(f"{server.url}/v2/health/ready", timeout=10).status_code == 200


def test_a_body_past_the_limit_is_413_by_length_or_as_it_streams(server: ServeProcess) -> None:
    big = b'{"prompt": "' + b"a" * LIMIT + b'"}'
    answer = httpx.post(f"{server.url}/v3/images/generations", content=big, headers=_auth("body"), timeout=30)
    assert answer.status_code == 413 and answer.headers["connection"] == "close"
    error = answer.json()["error"]
    assert error["code"] == "body_too_large" and f"{len(big)} bytes (Content-Length)" in error["message"]

    chunk = b"a" * 1000  # chunked, no Content-Length: cut off once it passes LIMIT, the rest never sent
    sock = _raw(server, _post_head("body", "Transfer-Encoding: chunked\r\n"))
    for _ in range(LIMIT // len(chunk) + 1):
        sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    data, _ = _answer(sock)
    assert data.startswith(b"HTTP/1.1 413 ") and b'"code":"body_too_large"' in data and b"chunked, cut off" in data

    def under_the_limit() -> Iterator[bytes]:  # a chunked body within the limit is read whole and served
        body = b'{"prompt": "%s", "num_inference_steps": 1, "rng_seed": 1}' % (PROMPT.encode() + b" " * 3000)
        yield from (body[i : i + 700] for i in range(0, len(body), 700))

    answer = httpx.post(
        f"{server.url}/v3/images/generations", content=under_the_limit(), headers=_auth("body"), timeout=60
    )
    assert answer.status_code == 200 and len(answer.json()["data"]) == 1
    assert refusals(server, "body_too_large") == 2
    assert _healthy(server)


def test_slow_headers_and_bodies_get_408_and_hold_no_worker(server: ServeProcess) -> None:
    slow_body = _raw(server, _post_head("slow", "Content-Type: application/json\r\nContent-Length: 100\r\n"), b"{")
    slow_head = _raw(server, "POST /v3/images/generations HTTP/1.1\r\nHost: x\r\n")
    silent = _raw(server, "")
    # meanwhile the one worker serves a request that came whole
    answer = httpx.post(
        f"{server.url}/v3/images/generations",
        json={"prompt": PROMPT, "num_inference_steps": 1, "rng_seed": 2},
        headers=_auth("slow"),
        timeout=60,
    )
    assert answer.status_code == 200
    for sock, said in ((slow_body, b'"code":"read_timeout"'), (slow_head, b""), (silent, None)):
        data, seconds = _answer(sock)
        assert seconds < READ_S + 10, seconds
        if said is None:  # nothing sent: closed without an answer
            assert data == b""
        else:
            assert data.startswith(b"HTTP/1.1 408 ") and said in data, data
    assert refusals(server, "read_timeout") == 1
    assert refusals(server, "header_timeout") == 1
    assert _healthy(server)


def test_past_the_rate_one_key_gets_429_with_retry_after_while_another_passes(server: ServeProcess) -> None:
    for _ in range(PER_MINUTE):
        assert httpx.get(f"{server.url}/v1/models", headers=_auth("rate1")).status_code == 200
    for path in ("/metrics", "/v2/health/live"):  # not counted
        assert httpx.get(f"{server.url}{path}", headers=_auth("rate1")).status_code == 200
    refused = httpx.get(f"{server.url}/v1/models", headers=_auth("rate1"))
    assert refused.status_code == 429
    retry = int(refused.headers["retry-after"])
    assert 1 <= retry <= 60 // PER_MINUTE
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "key rate1" in error["message"]
    assert httpx.get(f"{server.url}/v1/models", headers=_auth("rate2")).status_code == 200
    assert refusals(server, "rate_limit_exceeded") == 1


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


@pytest.fixture
def lo_addresses() -> Iterator[None]:
    """Two addresses outside 127.0.0.0/8 on lo, so a client on this machine can come from outside the allow-list."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("adding addresses to lo needs root and iproute2")
    added = []
    try:
        for address in (REFUSED, OUTSIDE):
            done = _ip("addr", "add", f"{address}/32", "dev", "lo")
            if done.returncode != 0:
                pytest.skip(f"ip addr add {address}/32 dev lo: {done.stderr.strip()}")
            added.append(address)
        yield
    finally:
        for address in added:
            _ip("addr", "del", f"{address}/32", "dev", "lo")


def test_an_address_outside_allow_from_is_refused_403(server: ServeProcess, lo_addresses: None) -> None:
    port = int(server.url.rsplit(":", 1)[1])

    def get(source: str) -> httpx.Response:
        with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=30) as client:
            return client.get(f"http://{REFUSED}:{port}/v1/models", headers=_auth("addr"))

    refused = get(REFUSED)
    assert refused.status_code == 403, refused.text  # a valid key does not help
    error = refused.json()["error"]
    assert error["code"] == "address_not_allowed" and re.search(
        rf"from {re.escape(REFUSED)} .*{OUTSIDE}/32", error["message"]
    )
    assert get(OUTSIDE).status_code == 200  # the allowed network
    assert httpx.get(f"{server.url}/v1/models", headers=_auth("addr")).status_code == 200  # loopback: always
    assert refusals(server, "address_not_allowed") == 1
    assert any('"status": 403' in ln and REFUSED in ln for ln in server.lines)  # the refusal is in the access log


def test_bad_limits_are_refused_at_start_up(ov_base: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for flag, said in (
        ("--allow-from=10.0.0.0/33", "--allow-from '10.0.0.0/33': not a network"),
        ("--allow-from=10.0.0.0/24,front", "--allow-from 'front': not a network"),
        ("--allow-from=10.0.0.1/24", "has host bits set"),
        ("--max-body-bytes=10", "--max-body-bytes must be at least 1024"),
        ("--read-timeout=0", "--read-timeout must be above 0"),
        ("--rate-limit=-1", "--rate-limit must be at least 0"),
    ):
        assert cli.main(["serve", str(ov_base), flag]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("xeonsd serve: error: ") and said in err[0], (flag, err)


def test_token_buckets_refill_at_the_rate_and_forget_idle_keys() -> None:
    now = [0.0]
    buckets = TokenBuckets(6, max_keys=3, clock=lambda: now[0])  # 6 a minute: one every 10 s
    assert [buckets.take("a") for _ in range(6)] == [0.0] * 6
    assert buckets.take("a") == pytest.approx(10.0)
    now[0] = 5.0
    assert buckets.take("a") == pytest.approx(5.0)  # half a token back: 5 s more
    now[0] = 10.0
    assert buckets.take("a") == 0.0 and buckets.take("b") == 0.0
    now[0] = 69.0
    buckets.take("c")
    assert len(buckets) == 3  # a (touched at 10 s) is not full yet: kept
    now[0] = 71.0
    buckets.take("d")  # a is full again (61 s idle): forgotten; b too
    assert len(buckets) == 2
    for key in "efgh":
        buckets.take(key)
    assert len(buckets) == 3  # past max_keys the least recently used go
