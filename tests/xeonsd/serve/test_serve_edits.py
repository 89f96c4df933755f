"""``POST /v3/images/edits`` over real HTTP: the OpenAI client's ``images.edit`` with and without a mask on the
tiny export (static batch 5 at 64 px: the edit pipelines are compiled for one image per call), and each bad image
refused with a 400 naming its field. The server (conftest.py's ``edit_server``) is shared with test_serve_blends.py.
"""

from __future__ import annotations

import base64
import io
import struct
import zlib

import httpx
import numpy as np
import pytest
from serve_process import PROMPT, ServeProcess, metric

from xeonsd.openvino.manifest import StaticShape
from xeonsd.serve.requests import Limits, RequestError, validate

pytestmark = pytest.mark.xdist_group("xeonsd-serve-edits")

SIZE = 64
STEPS = {"num_inference_steps": 3}


@pytest.fixture(scope="module")
def client(edit_server: ServeProcess):
    import openai

    return openai.OpenAI(base_url=f"{edit_server.url}/v3", api_key="unused", max_retries=0)


def _png(pixels: np.ndarray, mode: str | None = None) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels, mode).save(buf, format="PNG")
    return buf.getvalue()


def _decode(b64: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.float64)


SOURCE = np.random.default_rng(0).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
MASK = np.zeros((SIZE, SIZE), np.uint8)
MASK[:, : SIZE // 2] = 255  # repaint the left half


def _edit(client, seed: int, mask: bytes | None = None, n: int = 1, **extra) -> list[str]:
    kwargs = {} if mask is None else {"mask": ("mask.png", mask, "image/png")}
    result = client.images.edit(
        image=("in.png", _png(SOURCE), "image/png"),
        prompt=PROMPT,
        n=n,
        size=f"{SIZE}x{SIZE}",
        extra_body={"rng_seed": seed, "strength": 0.8, **STEPS, **extra},
        **kwargs,
    )
    return [item.b64_json for item in result.data]


def test_image_to_image_returns_images_of_the_size_unlike_the_input(client, edit_server: ServeProcess) -> None:
    before = metric(edit_server, "xeonsd_serve_requests_total", endpoint="/v3/images/edits", status="200")
    first, second = (_decode(b) for b in _edit(client, seed=5, n=2))
    assert first.shape == second.shape == (SIZE, SIZE, 3)
    assert np.abs(first - SOURCE).mean() > 5.0
    assert np.abs(first - second).mean() > 1.0  # two calls, seeds 5 and 6
    assert _edit(client, seed=5) == [_edit(client, seed=5, n=2)[0]]  # call k's seed is rng_seed + k: reproducible
    after = metric(edit_server, "xeonsd_serve_requests_total", endpoint="/v3/images/edits", status="200")
    assert after == before + 3


def test_inpainting_with_a_mask_differs_from_the_input_and_from_image_to_image(client) -> None:
    plain = _decode(_edit(client, seed=9)[0])
    painted = _decode(_edit(client, seed=9, mask=_png(MASK))[0])
    assert painted.shape == (SIZE, SIZE, 3)
    assert np.abs(painted - SOURCE).mean() > 5.0
    assert np.abs(painted - plain).mean() > 1.0


def test_an_openai_style_transparent_mask_is_read_as_the_gray_one(client) -> None:
    """OpenAI's mask repaints where alpha is 0; OVMS's where it is white: the two masks of one region agree."""
    rgba = np.zeros((SIZE, SIZE, 4), np.uint8)
    rgba[..., 3] = 255
    rgba[:, : SIZE // 2, 3] = 0
    assert _edit(client, seed=4, mask=_png(rgba, "RGBA")) == _edit(client, seed=4, mask=_png(MASK))


def _bomb() -> bytes:
    """A PNG whose header claims 100000 x 100000 pixels (its data is a few bytes: it is never decoded)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


BAD = [  # (files, fields, the field the error names, words of its message)
    ({"image": b"not an image at all"}, {}, "image", "not a PNG or JPEG"),
    ({"image": _bomb()}, {}, "image", "decompression bomb"),
    ({"image": _png(SOURCE[:32])}, {}, "image", "does not resize"),
    ({"image": _png(SOURCE), "mask": _png(MASK[:32, :32])}, {}, "mask", "one size"),
    ({"image": _png(SOURCE), "mask": b"GIF89a"}, {}, "mask", "not a PNG or JPEG"),
    ({"mask": _png(MASK)}, {}, "image", "image is required"),
    ({"image": _png(SOURCE)}, {"strength": "1.5"}, "strength", "out of range"),
    ({"image": _png(SOURCE)}, {"n": "two"}, "n", "must be an integer"),
    ({"image": _png(SOURCE)}, {"quality": "hd"}, "quality", "unknown field"),
]


@pytest.mark.parametrize(("files", "fields", "param", "words"), BAD, ids=[f"{p}-{w}" for _, _, p, w in BAD])
def test_each_bad_edit_is_refused_naming_the_field(
    edit_server: ServeProcess, files: dict, fields: dict, param: str, words: str
) -> None:
    before = metric(edit_server, "xeonsd_serve_rejected_total", param=param)
    answer = httpx.post(
        f"{edit_server.url}/v1/images/edits",
        files={k: (f"{k}.png", v, "image/png") for k, v in files.items()},
        data={"prompt": PROMPT, **fields},
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert metric(edit_server, "xeonsd_serve_rejected_total", param=param) == before + 1


def test_a_json_body_is_refused_as_not_multipart(edit_server: ServeProcess) -> None:
    answer = httpx.post(f"{edit_server.url}/v3/images/edits", json={"prompt": PROMPT})
    assert answer.status_code == 400 and "multipart/form-data" in answer.json()["error"]["message"], answer.text


def test_a_family_without_inpainting_refuses_the_mask_naming_the_family() -> None:
    """FLUX.2 [klein], Z-Image and Qwen-Image: GenAI 2026.4.1 has image-to-image but no inpainting for them."""
    from xeonsd.families import by_name

    limits = Limits(StaticShape(1, SIZE, SIZE, 1), ("base",), 1, 10, 4.0, family=by_name("zimage").label)
    limits = Limits(**{**limits.__dict__, "edits": by_name("zimage").genai_edits})
    image = np.zeros((SIZE, SIZE, 3), np.uint8)
    assert validate({"prompt": "p", "image": image}, limits, edit=True).kind == "image2image"
    with pytest.raises(RequestError, match="Z-Image has no inpainting") as caught:
        validate({"prompt": "p", "image": image, "mask": image}, limits, edit=True)
    assert caught.value.param == "mask"
