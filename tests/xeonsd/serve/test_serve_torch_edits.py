"""Image-to-image and inpainting on ``xeonsd serve --engine torch`` (:mod:`xeonsd.serve.torch_pool`) for a family
without reference images, over real HTTP through the ``openai`` client's ``images.edit``, on the tiny SD pipeline
with one LoRA registered:

* an image-to-image request's image is the one diffusers' own ``StableDiffusionImg2ImgPipeline`` makes for the same
  seed, strength and steps, and an inpainting request's the one ``StableDiffusionInpaintPipeline`` makes with the
  same mask (white repaints), equal to the byte in fp32, and another mask gives another image;
* the LoRA, picked per request by ``model``, applies to the edits too (the edit pipelines share the served
  pipeline's modules), and the base after it is the base again;
* a family whose diffusers pipelines have no edits (Krea 2) serves none, and says so per request; Krea 2 Turbo is
  served with its own 8 steps and no guidance.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from ov_assets import peft_adapter  # tests/xeonsd/conftest.py puts the OpenVINO tests' helpers on the path
from PIL import Image
from serve_process import ServeProcess

pytestmark = pytest.mark.xdist_group("xeonsd-serve-torch-edits")

SIZE = 64
STEPS = 4
SEED = 5
STRENGTH = 0.75
PROMPT = "a photo of toy"


def _png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _picture() -> np.ndarray:
    """A red square on a blue ground."""
    a = np.zeros((SIZE, SIZE, 3), np.uint8)
    a[:] = (30, 60, 200)
    a[16:48, 16:48] = (220, 40, 30)
    return a


def _left_half() -> np.ndarray:
    m = np.zeros((SIZE, SIZE, 3), np.uint8)
    m[:, : SIZE // 2] = 255
    return m


@pytest.fixture(scope="module")
def sd_lora(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A UNet LoRA (rank 2, random up matrices), written as our trainer writes one (ov_assets.peft_adapter)."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(tiny_model / "unet")
    return peft_adapter(unet, tmp_path_factory.mktemp("sd-lora"), ["to_q", "to_v"], seed=0, scale=2.0)


@pytest.fixture(scope="module")
def client(tiny_model: Path, sd_lora: Path, cli_env_module: dict[str, str]):
    import openai

    with ServeProcess.running(
        tiny_model,
        "--engine=torch",
        "--name=base",
        f"--adapter=toy={sd_lora}",
        f"--size={SIZE}x{SIZE}",
        "--precision=f32",
        env=cli_env_module,
    ) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0), server


def _edit(client, mask: np.ndarray | None = None, model: str = "base") -> np.ndarray:
    extra = {"rng_seed": SEED, "num_inference_steps": STEPS, "strength": STRENGTH}
    kwargs = {} if mask is None else {"mask": ("mask.png", _png(mask), "image/png")}
    result = client.images.edit(
        image=("image.png", _png(_picture()), "image/png"), prompt=PROMPT, model=model, extra_body=extra, **kwargs
    )
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).convert("RGB"), np.float64)


def _diffusers(tiny_model: Path, mask: np.ndarray | None) -> np.ndarray:
    from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline

    cls = StableDiffusionImg2ImgPipeline if mask is None else StableDiffusionInpaintPipeline
    pipe = cls.from_pretrained(tiny_model, safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    kwargs = {} if mask is None else {"mask_image": Image.fromarray(mask), "height": SIZE, "width": SIZE}
    image = pipe(
        prompt=[PROMPT],
        image=Image.fromarray(_picture()),
        strength=STRENGTH,
        num_inference_steps=STEPS,
        guidance_scale=7.5,
        generator=torch.Generator("cpu").manual_seed(SEED),
        **kwargs,
    ).images[0]
    return np.asarray(image, dtype=np.float64)


@pytest.mark.parametrize("kind", ["image2image", "inpainting"])
def test_an_edit_is_diffusers_own_and_the_lora_applies_to_it(kind, client, tiny_model: Path):
    api, server = client
    mask = _left_half() if kind == "inpainting" else None
    base, lora = _edit(api, mask), _edit(api, mask, model="toy")
    again, theirs = _edit(api, mask), _diffusers(tiny_model, mask)
    gap, effect = float(np.abs(base - theirs).max()), float(np.abs(lora - base).mean())
    print(f"\n{kind} on torch: max |dpixel| to diffusers {gap}; the LoRA moves it {effect:.1f} on average")
    assert gap == 0.0
    assert effect > 1.0
    assert np.array_equal(again, base)
    assert any(f'"kind": "{kind}"' in line for line in server.lines)
    if mask is not None:  # the mask is read: the other half repainted is another image
        assert np.abs(_edit(api, 255 - mask) - base).mean() > 1.0


def test_krea2_serves_no_edits_and_turbo_its_own_steps_and_guidance(tmp_path: Path):
    """Krea 2 has no edit pipelines in diffusers: an edit is refused naming the family. Its Turbo checkpoint
    (``is_distilled``) is served with what it asks for, 8 steps without guidance, as the trainer's validation images
    and ``xeonsd generate --engine torch`` make it; RAW with OVMS's 20 steps at the family's 4.5."""
    import json
    import shutil

    from xeonsd.assets import make_tiny_model
    from xeonsd.serve.options import ServeOptions
    from xeonsd.serve.prepare import prepare
    from xeonsd.serve.requests import Limits, RequestError, validate
    from xeonsd.serve.torch_pool import TorchWorker

    raw = make_tiny_model(tmp_path / "tiny-krea2", arch="tiny-krea2")
    turbo = tmp_path / "tiny-krea2-turbo"
    shutil.copytree(raw, turbo)
    index = json.loads((turbo / "model_index.json").read_text())
    (turbo / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    served = {m.name: prepare(ServeOptions(export_dir=m, engine="torch", size="64x64"), tmp_path) for m in (raw, turbo)}
    for model, (steps, guidance) in ((raw, (20, 4.5)), (turbo, (8, 0.0))):
        s = served[model.name]
        assert (s.engine, s.references, s.edits, s.default_steps, s.guidance_scale) == ("torch", 0, (), steps, guidance)
        limits = Limits(
            s.shape, ("base",), 1, 50, s.guidance_scale, family=s.family.label, default_steps=s.default_steps
        )
        req = validate({"prompt": "p"}, limits)
        assert (req.steps, req.guidance_scale) == (steps, guidance)
    limits = Limits(s.shape, ("base",), 1, 50, 4.5, family=s.family.label, engine="the PyTorch engine")
    body = {"prompt": "p", "image": np.zeros((64, 64, 3), np.uint8)}
    with pytest.raises(RequestError, match=r"Krea 2 has no image2image in the PyTorch engine \(it runs no edits"):
        validate(body, limits, edit=True)
    assert TorchWorker(pipe="t2i", edits={"inpainting": "inpaint"}).pipeline("image2image") == "t2i"
