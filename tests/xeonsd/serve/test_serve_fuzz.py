"""Generated bad input against a real ``xeonsd serve`` on the tiny export (hypothesis): any JSON body to the
generation routes, and any multipart body to the edit routes, gets a 200 or a 4xx with an OpenAI error object,
never a 5xx, and the server goes on answering. Bounded for CI: a fixed number of
examples, at most 2 steps and 2 images a request (``--max-steps``, ``--max-images``), one server for them all."""

from __future__ import annotations

import io
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from serve_process import PROMPT, ServeProcess

from xeonsd.serve.requests import KNOWN

pytestmark = pytest.mark.xdist_group("xeonsd-serve")
EXAMPLES = 120  # per property: 11-20 s here (2-core Zen 5, one worker); most bodies are refused early
BOUNDED = settings(
    max_examples=EXAMPLES,
    deadline=None,  # a request's time is the server's; the test's bound is EXAMPLES
    database=None,  # no .hypothesis/ in the checkout
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def server(ov_base: Path, cli_env_module: dict) -> Iterator[ServeProcess]:
    flags = ("--name=base", "--workers=1", "--max-steps=2", "--max-images=2", "--queue=64")
    with ServeProcess.running(ov_base, *flags, env=cli_env_module) as proc:
        yield proc


def _json_values() -> st.SearchStrategy:
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**70), max_value=2**70)
        | st.floats(allow_nan=True, allow_infinity=True)
        | st.text(max_size=40)
    )
    return st.recursive(
        scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner), max_leaves=8
    )


# Values near what the fields take, so that many bodies pass some checks and fail a later one (or generate).
PLAUSIBLE = {
    "prompt": st.sampled_from([PROMPT, "", "   ", "x" * 4001]) | st.text(max_size=30),
    "model": st.sampled_from(["base", "nope", ""]),
    "n": st.integers(-1, 3),
    "num_images_per_prompt": st.integers(0, 3),
    "num_inference_steps": st.integers(0, 3),
    "rng_seed": st.sampled_from([0, 2**32 - 1, 2**32, -1]),
    "size": st.sampled_from(["64x64", "auto", "512x512", "64X64", "x"]),
    "width": st.sampled_from([64, 65, 0]),
    "height": st.sampled_from([64, 65, 0]),
    "guidance_scale": st.sampled_from([1.0, 1.5, 7.5, 50.0, 50.1]),
    "response_format": st.sampled_from(["b64_json", "url"]),
    "negative_prompt": st.text(max_size=20),
    "user": st.text(max_size=10),
}
STATUSES: Counter[int] = Counter()  # of the generated requests, printed at the end
FIELDS = sorted(KNOWN | set(PLAUSIBLE))
bodies = st.one_of(
    st.binary(max_size=200),  # not JSON, or not UTF-8
    _json_values().map(lambda v: json.dumps(v).encode()),  # JSON, mostly not an object (NaN and Infinity too)
    st.dictionaries(  # known fields with any JSON value, and unknown ones
        st.sampled_from(FIELDS) | st.text(max_size=12), _json_values(), max_size=6
    ).map(lambda d: json.dumps(d).encode()),
    st.fixed_dictionaries(  # a prompt and plausible values: these reach the worker
        {"prompt": st.just(PROMPT)},
        optional={k: v | _json_values() for k, v in PLAUSIBLE.items() if k != "prompt"},
    ).map(lambda d: json.dumps(d).encode()),
)


@BOUNDED
@given(body=bodies, path=st.sampled_from(["/v3/images/generations", "/v1/images/generations"]))
@example(body=b"[" * 5000, path="/v3/images/generations")  # nesting deeper than Python's recursion limit
@example(body=b'{"prompt": "a", "guidance_scale": NaN}', path="/v3/images/generations")
@example(body=b'{"prompt": "a", "n": 1e999}', path="/v3/images/generations")
@example(body=b"\xff\xfe{}", path="/v3/images/generations")
@example(body=json.dumps({"prompt": PROMPT, "num_inference_steps": 2, "n": 2}).encode(), path="/v1/images/generations")
def _answers_any_json_body(server: ServeProcess, body: bytes, path: str) -> None:
    """The property: a 200 with images, or a 4xx with an OpenAI error object."""
    answer = httpx.post(f"{server.url}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert answer.status_code == 200 or 400 <= answer.status_code < 500, (answer.status_code, answer.text[:300])
    STATUSES[answer.status_code] += 1
    if answer.status_code == 200:
        assert answer.json()["data"][0]["b64_json"]
    else:
        error = answer.json()["error"]
        assert error["message"] and error["type"], error


def test_any_json_body_gets_a_200_or_a_4xx_and_the_server_goes_on(server: ServeProcess) -> None:
    _answers_any_json_body(server)  # hypothesis draws body and path, EXAMPLES times, then:
    print(f"statuses of the generated requests: {dict(sorted(STATUSES.items()))}")
    assert STATUSES[200] and STATUSES[400], STATUSES  # some bodies generated images, some were refused
    assert server.proc.poll() is None
    assert httpx.get(f"{server.url}/v2/health/ready", timeout=10).status_code == 200
    answer = httpx.post(
        f"{server.url}/v3/images/generations",
        json={"prompt": PROMPT, "num_inference_steps": 1, "rng_seed": 3},
        timeout=60,
    )
    assert answer.status_code == 200
    assert not [ln for ln in server.lines if "Traceback" in ln]  # no request failed inside the server


def _png(size: tuple[int, int], mode: str = "RGB") -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new(mode, size, 128 if mode == "L" else (90, 120, 200, 255)[: len(mode)]).save(out, format="PNG")
    return out.getvalue()


def _images() -> st.SearchStrategy:
    """Files for ``image`` and ``mask``: PNGs of the export's size (64 px) or not, other modes, cut ones, noise."""
    good = st.sampled_from([(64, 64, "RGB"), (64, 64, "L"), (64, 64, "RGBA"), (32, 64, "RGB"), (1, 1, "RGB")])
    pngs = good.map(lambda t: _png((t[0], t[1]), t[2]))
    return pngs | pngs.map(lambda b: b[: len(b) // 2]) | st.binary(max_size=100)


EDIT_TEXT = {
    "prompt": st.just(PROMPT) | st.text(max_size=20),
    "strength": st.sampled_from(["0.5", "1", "0", "1.5", "nan", "x"]),
    "n": st.sampled_from(["1", "2", "0", "1.0", ""]),
    "num_inference_steps": st.sampled_from(["1", "2", "3", "-1"]),
    "rng_seed": st.sampled_from(["0", "4294967296", "a"]),
    "model": st.sampled_from(["base", "nope", "@base:0.5"]),
    "size": st.sampled_from(["64x64", "32x32", "auto"]),
    "lora_alphas": st.sampled_from(["{}", "[1]", "{", '{"x": 1}']),
}
edit_forms = st.tuples(
    st.fixed_dictionaries({}, optional={"image": _images(), "mask": _images()}),
    st.fixed_dictionaries(
        {"prompt": EDIT_TEXT["prompt"]}, optional={k: v for k, v in EDIT_TEXT.items() if k != "prompt"}
    )
    | st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
)


@BOUNDED
@given(form=edit_forms, raw=st.none() | st.binary(max_size=300))
@example(form=({"image": _png((64, 64))}, {"prompt": PROMPT, "num_inference_steps": "1"}), raw=None)
def _answers_any_edit(server: ServeProcess, form: tuple[dict, dict], raw: bytes | None) -> None:
    """The property for the edit routes: a multipart form of generated files and fields, or ``raw`` bytes sent as a
    multipart body."""
    files, fields = form
    url = f"{server.url}/v3/images/edits"
    if raw is None:
        multipart = {k: (f"{k}.png", v, "image/png") for k, v in files.items()}
        answer = httpx.post(url, files=multipart or None, data=fields, timeout=60)
    else:
        headers = {"Content-Type": "multipart/form-data; boundary=xeonsd"}
        answer = httpx.post(url, content=b"--xeonsd\r\n" + raw, headers=headers, timeout=60)
    assert answer.status_code == 200 or 400 <= answer.status_code < 500, (answer.status_code, answer.text[:300])
    EDIT_STATUSES[answer.status_code] += 1
    if answer.status_code != 200:
        assert answer.json()["error"]["message"]


EDIT_STATUSES: Counter[int] = Counter()


def test_any_multipart_edit_gets_a_200_or_a_4xx_and_the_server_goes_on(server: ServeProcess) -> None:
    _answers_any_edit(server)
    print(f"statuses of the generated edits: {dict(sorted(EDIT_STATUSES.items()))}")
    assert EDIT_STATUSES[200] and EDIT_STATUSES[400], EDIT_STATUSES
    assert server.proc.poll() is None
    assert httpx.get(f"{server.url}/v2/health/ready", timeout=10).status_code == 200
    assert not [ln for ln in server.lines if "Traceback" in ln]
