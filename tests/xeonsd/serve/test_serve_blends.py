"""LoRA adapters and blends over real HTTP (conftest.py's ``edit_server``, shared with test_serve_edits.py: the tiny
export, adapters ``toy`` and ``other``): switching between the base model and an adapter gives the same images each
time (OpenVINO GenAI 2026.4.1 switches adapters on a pipeline wrongly, so the pool never does); ``model`` as an OVMS
composite (``@toy:0.7+@other:0.5``) and OVMS's ``lora_alphas`` are read and checked; a blend declared with
``--blend`` runs on its own pipelines, any other is refused, and a bad ``--blend`` stops the server at start-up."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from serve_process import PROMPT, ServeProcess

from xeonsd import cli
from xeonsd.openvino.manifest import StaticShape
from xeonsd.serve.requests import Limits, RequestError, validate

pytestmark = pytest.mark.xdist_group("xeonsd-serve-edits")

BLEND = "@toy:0.7+@other:0.5"


def _image(server: ServeProcess, model: str, edit: bool = False, alphas: dict | None = None) -> bytes:
    """One image of ``model`` (with ``lora_alphas``) at a fixed seed: generated, or an image-to-image edit of a fixed
    picture."""
    body = {"prompt": PROMPT, "model": model, "rng_seed": 7, "num_inference_steps": 2, "n": 1}
    if alphas is not None:
        body["lora_alphas"] = json.dumps(alphas) if edit else alphas
    if edit:
        files = {"image": ("in.png", _source_png(), "image/png")}
        data = {k: str(v) for k, v in {**body, "size": "64x64", "strength": 0.9}.items()}
        answer = httpx.post(f"{server.url}/v3/images/edits", data=data, files=files, timeout=60)
    else:
        answer = httpx.post(f"{server.url}/v3/images/generations", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return base64.b64decode(answer.json()["data"][0]["b64_json"])


def _source_png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("edit", [False, True], ids=["generation", "image2image"])
def test_switching_adapters_gives_the_same_image_each_time(edit_server: ServeProcess, edit: bool) -> None:
    """base, toy, base, toy, other, toy: each model's image is the same bytes every time, and the models differ.
    (On one GenAI pipeline that switches, the second toy comes out as the base image or gray.)"""
    seen: dict[str, bytes] = {}
    for model in ("base", "toy", "base", "toy", "other", "toy"):
        image = _image(edit_server, model, edit)
        assert seen.setdefault(model, image) == image, f"{model} changed after a switch"
    assert len(set(seen.values())) == 3, "the adapters did not change the image"


def test_a_declared_blend_runs_on_its_own_pipelines_in_any_spelling(edit_server: ServeProcess) -> None:
    """--blend @toy:0.7+@other:0.5 and --blend @toy:0.5 (conftest): each blend's image differs from the base's and
    each part's, is the same bytes every time, and is reached by its parts in any order or through lora_alphas."""
    base, toy, other = (_image(edit_server, m) for m in ("base", "toy", "other"))
    blend = _image(edit_server, BLEND)
    assert len({base, toy, other, blend}) == 4, "the blend's image is one of its parts' or the base's"
    for spelling in (BLEND, "@other:0.5+@toy:0.7", ("@toy+@other", {"toy": 0.7, "other": 0.5})):
        model, alphas = spelling if isinstance(spelling, tuple) else (spelling, None)
        assert _image(edit_server, model, alphas=alphas) == blend, spelling
    half = _image(edit_server, "@toy:0.5")  # a blend of one: toy at another weight than its --adapter alpha
    assert half not in (base, toy, other, blend)
    assert _image(edit_server, "toy", alphas={"toy": 0.5}) == half
    assert _image(edit_server, BLEND, edit=True) not in (_image(edit_server, m, edit=True) for m in ("base", "toy"))


def test_models_list_the_declared_blends(edit_server: ServeProcess) -> None:
    ids = [m["id"] for m in httpx.get(f"{edit_server.url}/v1/models").json()["data"]]
    assert ids == ["base", "toy", "other", "@other:0.5+@toy:0.7", "@toy:0.5"]


def test_an_undeclared_blend_is_refused_naming_the_declared_ones_and_blend(edit_server: ServeProcess) -> None:
    """Any other blend or weight would need a compile of its own (docs/serving.md, "LoRA blends"): 400."""
    for body, param in (
        ({"model": "@toy:0.6+@other:0.5"}, "model"),
        ({"model": "@other"}, None),  # one adapter at its own alpha: the adapter itself
        ({"model": "toy", "lora_alphas": {"toy": 0.25}}, "lora_alphas"),
    ):
        # a generation (the 200) takes seconds on a loaded 2-core machine: more than httpx's default 5 s
        answer = httpx.post(f"{edit_server.url}/v3/images/generations", json={"prompt": PROMPT, **body}, timeout=120)
        if param is None:
            assert answer.status_code == 200, answer.text
            continue
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == param and error["code"] == "unsupported", error
        assert "--blend '@" in error["message"] and "declared: @other:0.5+@toy:0.7, @toy:0.5" in error["message"]


@pytest.mark.parametrize(
    ("blend", "words"),
    [
        ("@toy:0.7+@nope:0.3", "no adapter 'nope'"),
        ("@toy:5", "out of range: -4..4"),
        ("@toy", "one adapter at its own --adapter alpha"),
        ("@toy:0.5+@toy:0.6", "given twice"),
        ("toy:0.5", "is not @NAME or @NAME:WEIGHT"),
    ],
)
def test_a_bad_blend_is_refused_at_start_up(
    ov_base: Path, toy_adapter: Path, capsys: pytest.CaptureFixture[str], blend: str, words: str
) -> None:
    """A one-line error naming the --blend, exit 2, before anything is compiled."""
    assert cli.main(["serve", str(ov_base), f"--adapter=toy={toy_adapter}", f"--blend={blend}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--blend {blend!r}" in err[0] and words in err[0], err


BAD = [  # (model, lora_alphas, status, the field the error names, words of its message)
    ("@toy:0.7+@nope:0.3", None, 400, "model", "no adapter 'nope'"),
    ("@toy:lots", None, 400, "model", "must be a number"),
    ("@toy:9", None, 400, "model", "out of range"),
    ("@toy+@toy", None, 400, "model", "given twice"),
    ("toy", {"other": 0.5}, 400, "lora_alphas", "not an adapter that model"),
    ("base", {"toy": 0.5}, 400, "lora_alphas", "none (the base model)"),
    (BLEND, {"toy": "nan"}, 400, "lora_alphas", "must be a number"),
    ("toy+other", None, 404, "model", "@NAME:WEIGHT"),
]


@pytest.mark.parametrize(("model", "alphas", "status", "param", "words"), BAD, ids=[b[0] + str(b[1]) for b in BAD])
def test_each_bad_blend_is_refused_naming_the_field(
    edit_server: ServeProcess, model: str, alphas: dict | None, status: int, param: str, words: str
) -> None:
    body = {"prompt": PROMPT, "model": model, **({} if alphas is None else {"lora_alphas": alphas})}
    answer = httpx.post(f"{edit_server.url}/v3/images/generations", json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_family_served_fused_refuses_a_blend_naming_the_family() -> None:
    """SD3 and Z-Image: GenAI applies no adapters, the pool serves an export with the LoRA fused in."""
    limits = Limits(StaticShape(1, 64, 64, 1), ("base",), 1, 10, 7.0, family="SD3", fused_only=True)
    with pytest.raises(RequestError, match="applies no adapters to SD3") as caught:
        validate({"prompt": "p", "model": "@toy:0.5"}, limits)
    assert caught.value.param == "model"
