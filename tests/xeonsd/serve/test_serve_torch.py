"""``xeonsd serve --engine torch`` (:mod:`xeonsd.serve.torch_pool`) over real HTTP, on the tiny Qwen-Image-Edit-2511
pipeline (``make-tiny-model --arch tiny-qwenimage-edit``: a family optimum-intel has no export for, so ``--engine
auto`` picks torch), with one LoRA registered, through the ``openai`` client's ``images.edit`` (a list of images is
sent as OpenAI's ``image[]`` parts):

* the base request's image is the one diffusers' own ``QwenImageEditPlusPipeline`` makes for the same seed, size,
  guidance and reference; the LoRA, picked per request by ``model``, changes it, and the base after it is the base
  again (the adapter is switched, never loaded per request);
* with two references the image depends on each of them;
* four references (the family takes 1 to 3), a reference that is not an image, a mask, and a text-only request are
  each a 400 naming the family or the field.

Images are compared as uint8 PNG pixels (0..255), in fp32 (``--precision f32``), where the server and diffusers run
the same operations on the same thread count: the tolerance is exact equality (the figures are printed).
"""

from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path
from unittest import mock

import httpx
import numpy as np
import pytest
import torch
from ov_assets import FLOW_TARGETS  # conftest.py puts the OpenVINO tests' helpers on the path
from PIL import Image
from serve_process import ServeProcess

pytestmark = pytest.mark.xdist_group("xeonsd-serve-torch")

SIZE = 64
STEPS = 2
SEED = 3
PROMPT = "make the square blue"
LONG = 100_000  # steps of the request a client gives up on: minutes of work at any speed (a step is milliseconds)


def _png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _ref(box: tuple[int, int, int, int], color: tuple[int, int, int]) -> bytes:
    a = np.zeros((SIZE, SIZE, 3), np.uint8)
    a[box[0] : box[1], box[2] : box[3]] = color
    return _png(a)


RED = _ref((10, 40, 10, 40), (230, 30, 30))
GREEN = _ref((40, 60, 5, 60), (30, 200, 30))
WHITE = _png(np.full((SIZE, SIZE, 3), 255, np.uint8))


def _claims(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` pixels (its data is a few bytes: it is never decoded)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


@pytest.fixture(scope="module")
def qwen_edit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from xeonsd.assets import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("assets") / "tiny-qwenimage-edit", arch="tiny-qwenimage-edit")


@pytest.fixture(scope="module")
def edit_lora(qwen_edit: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A transformer LoRA (rank 2, alpha 4, random up matrices), saved by the family's diffusers pipeline."""
    from diffusers import QwenImageEditPlusPipeline, QwenImageTransformer2DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer = QwenImageTransformer2DModel.from_pretrained(qwen_edit / "transformer")
    transformer.add_adapter(LoraConfig(r=2, lora_alpha=4, init_lora_weights="gaussian", target_modules=FLOW_TARGETS))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 2.0)
    out = tmp_path_factory.mktemp("qwen-edit-lora")
    QwenImageEditPlusPipeline.save_lora_weights(
        out, transformer_lora_layers=get_peft_model_state_dict(transformer), safe_serialization=True
    )
    return out / "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def server(qwen_edit: Path, edit_lora: Path, cli_env_module: dict[str, str]):
    with ServeProcess.running(
        qwen_edit,
        "--name=base",
        f"--adapter=toy.v1={edit_lora}",  # a '.' in the name: the pipeline's adapter name is its own
        f"--size={SIZE}x{SIZE}",
        "--precision=f32",
        "--queue=2",
        f"--max-steps={LONG}",
        env=cli_env_module,
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServeProcess):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _edit(client, refs: list[bytes], model: str = "base") -> np.ndarray:
    images = [(f"ref{i}.png", r, "image/png") for i, r in enumerate(refs)]
    result = client.images.edit(
        image=images if len(images) > 1 else images[0],
        prompt=PROMPT,
        model=model,
        extra_body={"rng_seed": SEED, "num_inference_steps": STEPS},
    )
    pixels = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).convert("RGB")
    return np.asarray(pixels, dtype=np.float64)


def _diffusers(qwen_edit: Path, ref: bytes) -> np.ndarray:
    from diffusers import QwenImageEditPlusPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as module

    from xeonsd.families import by_name
    from xeonsd.families.qwenimage_edit.processor import VisionProcessor

    spec = by_name("qwenimage_edit")
    pipe = QwenImageEditPlusPipeline.from_pretrained(qwen_edit, processor=VisionProcessor.from_pretrained(qwen_edit))
    pipe.set_progress_bar_config(disable=True)
    with mock.patch.object(module, "VAE_IMAGE_SIZE", SIZE * SIZE):  # the family's rendering: the image's area
        image = pipe(
            prompt=[PROMPT],
            image=Image.open(io.BytesIO(ref)).convert("RGB"),
            height=SIZE,
            width=SIZE,
            true_cfg_scale=spec.guidance_scale,
            max_sequence_length=spec.prompt_length_of(qwen_edit),
            num_inference_steps=STEPS,
            generator=torch.Generator("cpu").manual_seed(SEED),
        ).images[0]
    return np.asarray(image, dtype=np.float64)


def test_the_base_is_diffusers_own_image_and_the_lora_applies_per_request(client, server, qwen_edit: Path):
    base = _edit(client, [RED])
    lora = _edit(client, [RED], model="toy.v1")
    again = _edit(client, [RED])
    theirs = _diffusers(qwen_edit, RED)
    gap, effect = float(np.abs(base - theirs).max()), float(np.abs(lora - base).mean())
    print(f"\nserved on torch: max |dpixel| to diffusers {gap}; the LoRA moves it {effect:.1f} on average")
    assert gap == 0.0
    assert effect > 5.0
    assert np.array_equal(again, base)  # switched off again, not left on
    assert any('"kind": "reference"' in line for line in server.lines)  # the access log's request kind


def test_two_references_each_shape_the_image(client):
    """Replacing either of two references (by a white image) changes the image: the tiny random model reads them
    weakly (a fraction of a level on average), but it reads each."""
    both = _edit(client, [RED, GREEN])
    moved = [np.abs(both - _edit(client, refs)) for refs in ([WHITE, GREEN], [RED, WHITE])]
    for which, m in zip(("first", "second"), moved, strict=True):
        print(f"\ntwo references: another {which} moves the image {m.max():.0f} at most, {(m > 0).mean():.0%} of it")
        assert m.max() >= 2 and (m > 0).mean() > 0.1


def _post(server: ServeProcess, files: list[tuple[str, tuple[str, bytes, str]]], path: str = "/v1/images/edits"):
    data = {"prompt": PROMPT, "num_inference_steps": str(STEPS)}
    return httpx.post(f"{server.url}{path}", data=data, files=files, timeout=60)


@pytest.mark.parametrize(
    ("parts", "param", "words"),
    [
        ([("image[]", RED)] * 4, "image[]", "Qwen-Image-Edit-2511 edits by instruction from 1 to 3 reference image"),
        ([("image[]", RED), ("image[]", b"not a png")], "image[]", "image[] is not a PNG or JPEG image"),
        ([("image[]", RED), ("image[]", _claims(5000, 5000))], "image[]", "image[] is 5000x5000 pixels, more than"),
        ([("image", RED), ("mask", RED)], "mask", "takes no mask"),
    ],
    ids=["four-references", "not-an-image", "too-large", "a-mask"],
)
def test_a_request_of_the_wrong_kind_is_a_400_naming_what_the_family_takes(server, parts, param, words):
    answer = _post(server, [(key, (f"{key}.png", data, "image/png")) for key, data in parts])
    error = answer.json()["error"]
    assert (answer.status_code, error["param"]) == (400, param), error
    assert words in error["message"], error
    text = httpx.post(f"{server.url}/v1/images/generations", json={"prompt": PROMPT}, timeout=30)
    assert text.status_code == 400 and "makes no image from text alone" in text.json()["error"]["message"]


def test_a_client_that_goes_away_stops_its_request_at_the_next_step(server):
    """The step callback sets diffusers' _interrupt once the job is cancelled: a LONG-step request whose client gives
    up after a second and a half ends far short of its steps (the access line counts them), and the worker serves
    again. (At 100 steps a quiet machine finished before the client gave up.)"""
    import json
    import time

    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            f"{server.url}/v1/images/edits",
            data={"prompt": PROMPT, "num_inference_steps": str(LONG)},
            files=[("image[]", ("ref.png", RED, "image/png"))],
            timeout=1.5,
        )
    deadline = time.monotonic() + 60
    while not (lines := [json.loads(x) for x in list(server.lines) if '"cancelled": "disconnect"' in x]):
        assert time.monotonic() < deadline, "\n".join(server.lines[-20:])
        time.sleep(0.05)
    print(f"\ncancelled by the client after {lines[0]['steps_done']} of {LONG} steps")
    assert lines[0]["steps_done"] < LONG
    assert _post(server, [("image[]", ("ref.png", RED, "image/png"))]).status_code == 200


def test_what_an_engine_cannot_serve_is_refused_before_anything_loads(qwen_edit: Path, tmp_path: Path):
    from xeonsd.assets import make_tiny_model
    from xeonsd.openvino.manifest import MANIFEST
    from xeonsd.serve.metrics import Metrics
    from xeonsd.serve.options import ServeError, ServeOptions
    from xeonsd.serve.prepare import choose_engine, prepare
    from xeonsd.serve.server import open_pool

    klein = make_tiny_model(tmp_path / "tiny-flux2", arch="tiny-flux2")
    export = tmp_path / "export"
    export.mkdir()
    (export / MANIFEST).write_text("{}")
    assert choose_engine(ServeOptions(export_dir=qwen_edit))[0] == "torch"  # no OpenVINO export: auto is torch
    assert choose_engine(ServeOptions(export_dir=klein, engine="torch"))[0] == "torch"  # any family, when asked
    for opts, words in (
        (ServeOptions(export_dir=klein), "run `xeonsd export"),
        (ServeOptions(export_dir=qwen_edit, engine="genai"), "or give --engine torch"),
        (ServeOptions(export_dir=export, engine="torch"), "serves a diffusers pipeline directory"),
        (ServeOptions(export_dir=export, size="64x64"), "--size is the torch engine's"),
    ):
        with pytest.raises(ServeError, match=words):
            choose_engine(opts)
    with pytest.raises(ServeError, match="each side must be a positive multiple of 16"):
        prepare(ServeOptions(export_dir=qwen_edit, size="60x64"), tmp_path)
    served = prepare(ServeOptions(export_dir=qwen_edit, size="64x64"), tmp_path)
    assert (served.engine, served.references, served.edits) == ("torch", 3, ())
    with pytest.raises(ServeError, match="the torch engine runs one request at a time"):
        open_pool(served, ServeOptions(export_dir=qwen_edit, workers=2), Metrics(), cores=2)
