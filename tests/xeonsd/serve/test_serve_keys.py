"""``xeonsd serve --api-key-file``: a real server on the tiny export. Without a key or with a wrong one every route but
the health checks answers 401 with an OpenAI error object; the ``openai`` client with ``api_key=`` works unchanged;
the access log and /metrics carry the key's name and never the key; SIGHUP reloads the file (a broken file keeps the
keys in force); a bad key file is refused before anything compiles; no key file beyond loopback warns."""

from __future__ import annotations

import json
import logging
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve_process import PROMPT, ServeProcess

from xeonsd.serve.keys import KeyFileError, parse_keys

ALICE, BOB, CAROL = "alice-" + "a" * 20, "b" * 24, "carol-" + "c" * 20


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("keys") / "keys", f"# who may call\nalice:{ALICE}\n\n{BOB}\n")


@pytest.fixture(scope="module")
def server(ov_base: Path, key_file: Path, cli_env_module: dict[str, str]) -> Iterator[ServeProcess]:
    # start() polls /v2/health/ready without a key: the health checks stay open
    with ServeProcess.running(
        ov_base, "--name=base", "--workers=1", f"--api-key-file={key_file}", env=cli_env_module
    ) as proc:
        yield proc


def _get(server: ServeProcess, path: str, key: str | None = None) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.get(f"{server.url}{path}", headers=headers, timeout=30)


def test_every_route_but_health_needs_a_key_and_the_openai_client_sends_it(server: ServeProcess) -> None:
    import openai

    assert _get(server, "/v2/health/live").status_code == 200
    for path in ("/v1/models", "/metrics"):
        for key in (None, "x" * 20):
            answer = _get(server, path, key)
            assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer", (path, key)
            assert answer.json()["error"]["code"] == "invalid_api_key"
    assert "No API key provided" in _get(server, "/v1/models").json()["error"]["message"]
    assert [m["id"] for m in _get(server, "/v1/models", BOB).json()["data"]] == ["base"]

    refused = openai.OpenAI(base_url=f"{server.url}/v3", api_key="wrong-" + "w" * 20, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        refused.images.generate(prompt=PROMPT, n=1, extra_body={"num_inference_steps": 2})
    client = openai.OpenAI(base_url=f"{server.url}/v3", api_key=ALICE, max_retries=0)
    result = client.images.generate(prompt=PROMPT, n=1, extra_body={"num_inference_steps": 2, "rng_seed": 1})
    assert len(result.data) == 1 and result.data[0].b64_json

    metrics = _get(server, "/metrics", BOB).text
    assert 'xeonsd_serve_key_requests_total{key="alice"}' in metrics and 'key="key1"' in metrics
    assert 'key="(none)"' in metrics
    lines = [json.loads(ln) for ln in server.lines if ln.startswith("{")]
    assert {"alice", "key1", None} <= {ln.get("key") for ln in lines if "key" in ln}
    assert not [ln for ln in server.lines if ALICE in ln or BOB in ln]  # a key is never logged


def test_sighup_reloads_the_keys_and_a_broken_file_keeps_them(server: ServeProcess, key_file: Path) -> None:
    _write(key_file, f"carol:{CAROL}\n")
    server.proc.send_signal(signal.SIGHUP)
    seen = len(server.lines)
    assert _wait(lambda: _get(server, "/v1/models", CAROL).status_code == 200)
    assert _get(server, "/v1/models", ALICE).status_code == 401  # alice's key is gone
    _write(key_file, "short\n")
    server.proc.send_signal(signal.SIGHUP)
    assert _wait(lambda: any("API keys are unchanged" in ln for ln in server.lines[seen:]))
    assert _get(server, "/v1/models", CAROL).status_code == 200  # the keys in force stay


def _wait(done, seconds: float = 20) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if done():
            return True
        time.sleep(0.1)
    return False


def test_a_bad_key_file_is_refused_by_line_and_no_key_beyond_loopback_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from xeonsd.serve.options import ServeError, ServeOptions
    from xeonsd.serve.server import _key_ring

    assert parse_keys(f"a:{ALICE}\n{BOB}\n{CAROL}\n", "k") == {
        "a": ALICE.encode(),
        "key1": BOB.encode(),
        "key2": CAROL.encode(),
    }
    for text, said in (
        ("", "holds no key"),
        ("short\n", "line 1 (key1): a key is at least 16"),
        (f"a:{ALICE}\na:{BOB}\n", "line 2: the name a is given twice"),
        (f"a:{ALICE}\nb:{ALICE}\n", "line 2 (b): the same key is given twice"),
        (f"a b:{ALICE}\n", "'a b' is not a key name"),
    ):
        with pytest.raises(KeyFileError, match=re.escape(said)):
            parse_keys(text, "k")
    with pytest.raises(ServeError, match="cannot be read"):
        _key_ring(ServeOptions(export_dir=tmp_path, api_key_file=tmp_path / "missing"))
    with caplog.at_level(logging.WARNING, logger="xeonsd.serve.server"):
        assert _key_ring(ServeOptions(export_dir=tmp_path, host="127.0.0.1")) is None
        assert not caplog.records
        assert _key_ring(ServeOptions(export_dir=tmp_path, host="0.0.0.0")) is None
    assert "no --api-key-file: anyone who reaches 0.0.0.0:8000" in caplog.text
