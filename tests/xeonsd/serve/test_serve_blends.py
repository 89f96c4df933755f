"""LoRA adapters and blends over real HTTP (conftest.py's ``edit_server``, shared with test_serve_edits.py: the tiny
export, adapters ``toy`` and ``other``): switching between the base model and an adapter gives the same images each
time (OpenVINO GenAI 2026.4.1 switches adapters on a pipeline wrongly, so the pool never does); ``model`` as an OVMS
composite (``@toy:0.7+@other:0.5``) and OVMS's ``lora_alphas`` are read and checked, and a blend is refused."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from serve_process import PROMPT, ServeProcess

from xeonsd.openvino.manifest import StaticShape
from xeonsd.serve.requests import Limits, RequestError, validate

pytestmark = pytest.mark.xdist_group("xeonsd-serve-edits")

BLEND = "@toy:0.7+@other:0.5"


def _image(server: ServeProcess, model: str, edit: bool = False) -> bytes:
    """One image of ``model`` at a fixed seed: generated, or an image-to-image edit of a fixed picture."""
    body = {"prompt": PROMPT, "model": model, "rng_seed": 7, "num_inference_steps": 2, "n": 1}
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


def test_a_blend_or_another_weight_is_refused_as_unsupported(edit_server: ServeProcess) -> None:
    """GenAI 2026.4.1 mixes several adapters' weights wrongly (docs/serving.md, "LoRA blends"): refused, 400."""
    for body, param in (
        ({"model": BLEND}, "model"),
        ({"model": "@toy"}, None),  # one adapter at its own alpha: the adapter itself
        ({"model": "toy", "lora_alphas": {"toy": 0.5}}, "lora_alphas"),
    ):
        answer = httpx.post(f"{edit_server.url}/v3/images/generations", json={"prompt": PROMPT, **body})
        if param is None:
            assert answer.status_code == 200, answer.text
            continue
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == param and error["code"] == "unsupported" and "GenAI 2026.4.1" in error["message"]


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
