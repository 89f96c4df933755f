"""``xeonsd generate --engine torch`` (:mod:`xeonsd.torch_engine`) on the tiny FLUX.1 Kontext and Qwen-Image-Edit
pipelines, the families optimum-intel has no OpenVINO export for:

* its image is the one the family's own diffusers pipeline makes with the same seed and call, with and without a
  LoRA (loaded by diffusers' ``load_lora_weights`` on both sides), and the LoRA changes it;
* an edit model's image depends on its reference image (``--image``);
* Krea 2 runs on it too, a Turbo checkpoint at its own guidance;
* what it cannot do is refused in one line: ``--engine openvino`` for a family without an export, more reference
  images than the family takes, none where it needs one, references for a text-to-image family.

Images are compared as uint8 PNG pixels (0..255); the tests run in fp32 (``--precision f32``), where the engine and
diffusers run the same operations: the tolerance is exact equality (the figures are printed).
"""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from ov_assets import cli_error, flow_lora
from PIL import Image

from xeonsd import cli

PROMPT = "make the square blue"
STEPS = 2
SEED = 3


@pytest.fixture(scope="module")
def kontext(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from xeonsd.assets import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("assets") / "tiny-flux-kontext", arch="tiny-flux-kontext")


@pytest.fixture(scope="module")
def qwen_edit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from xeonsd.assets import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("assets") / "tiny-qwenimage-edit", arch="tiny-qwenimage-edit")


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two 64x64 references: a red square, and a green bar elsewhere."""
    root = tmp_path_factory.mktemp("refs")
    out = []
    for i, (box, color) in enumerate((((10, 40, 10, 40), (230, 30, 30)), ((40, 60, 5, 60), (30, 200, 30)))):
        a = np.zeros((64, 64, 3), np.uint8)
        a[box[0] : box[1], box[2] : box[3]] = color
        Image.fromarray(a).save(root / f"ref{i}.png")
        out.append(root / f"ref{i}.png")
    return out


def _generate(src: Path, out: Path, *flags: str, precision: str = "f32", dtype: str = "float32") -> np.ndarray:
    args = ["generate", str(src), "--prompt", PROMPT, "--num-images", "1", "--steps", str(STEPS)]
    args += ["--seed", str(SEED), "--precision", precision, "--out", str(out), *flags]
    assert cli.main(args) == 0
    timings = json.loads((out / "timings.json").read_text())
    assert (timings["engine"], timings["torch_dtype"], timings["seeds"]) == ("torch", dtype, [SEED])
    return np.asarray(Image.open(out / "image_000.png"), dtype=np.float64)


def _kontext_call(kontext: Path, ref: Path) -> dict:
    """What the engine gives FluxKontextPipeline besides the prompt, steps and generator (64 px, references of the
    image's size)."""
    from xeonsd.families import by_name

    spec = by_name("flux_kontext")
    return {
        "image": Image.open(ref).convert("RGB"),
        "height": 64,
        "width": 64,
        "max_area": 64 * 64,
        "_auto_resize": False,
        "guidance_scale": spec.guidance_scale,
        "max_sequence_length": spec.prompt_length_of(kontext),
    }


def _diffusers(pipe, **call) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    image = pipe(
        prompt=[PROMPT], num_inference_steps=STEPS, generator=torch.Generator("cpu").manual_seed(SEED), **call
    ).images[0]
    return np.asarray(image, dtype=np.float64)


def test_kontext_images_are_diffusers_own_with_and_without_a_lora(kontext: Path, refs: list[Path], tmp_path: Path):
    """Auto picks the torch engine for Kontext; its image equals FluxKontextPipeline's for the same seed, size,
    guidance and reference, and so with a LoRA loaded by load_lora_weights, which moves the image."""
    from diffusers import FluxKontextPipeline

    lora = flow_lora(kontext, "flux_kontext", tmp_path / "lora")
    ours = _generate(kontext, tmp_path / "base", "--image", str(refs[0]))
    ours_lora = _generate(kontext, tmp_path / "lora-out", "--image", str(refs[0]), "--lora", f"{lora}:1.0")
    pipe = FluxKontextPipeline.from_pretrained(kontext)
    call = _kontext_call(kontext, refs[0])
    theirs = _diffusers(pipe, **call)
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    theirs_lora = _diffusers(pipe, **call)
    gaps = [float(np.abs(ours - theirs).max()), float(np.abs(ours_lora - theirs_lora).max())]
    effect = float(np.abs(ours_lora - ours).mean())
    print(f"\nKontext max |dpixel| to diffusers: {gaps[0]} (LoRA {gaps[1]}); the LoRA moves it {effect:.1f} on average")
    assert gaps == [0.0, 0.0]
    assert effect > 5.0


def test_bf16_where_the_cpu_has_it_and_then_diffusers_own_bf16_image(
    kontext: Path, refs: list[Path], tmp_path: Path, monkeypatch
):
    """--precision auto: bf16 on AMX or AVX512-BF16 (the trainer's mixed_precision auto), fp32 elsewhere; on this
    machine's CPU the image equals FluxKontextPipeline's loaded in its dtype."""
    from diffusers import FluxKontextPipeline

    from xeonsd import cpu
    from xeonsd.torch_engine import torch_dtype

    for flags, want in (
        ({"amx_bf16", "amx_tile"}, torch.bfloat16),
        ({"avx512_bf16"}, torch.bfloat16),
        (set(), torch.float32),
    ):
        monkeypatch.setattr(cpu, "cpu_info", lambda flags=flags: cpu.CpuInfo("x", frozenset(flags)))
        assert (torch_dtype("auto"), torch_dtype("f32")) == (want, torch.float32), flags
    monkeypatch.undo()
    dtype = torch_dtype("auto")
    name = str(dtype).removeprefix("torch.")
    ours = _generate(kontext, tmp_path / "auto", "--image", str(refs[0]), precision="auto", dtype=name)
    theirs = _diffusers(
        FluxKontextPipeline.from_pretrained(kontext, torch_dtype=dtype), **_kontext_call(kontext, refs[0])
    )
    gap = float(np.abs(ours - theirs).max())
    print(f"\nKontext in {name} ({cpu.cpu_info().native_bf16 or 'no native bf16'}): max |dpixel| to diffusers {gap}")
    assert gap == 0.0


def test_a_qwen_edit_image_is_diffusers_own_and_depends_on_its_reference(
    qwen_edit: Path, refs: list[Path], tmp_path: Path
):
    """QwenImageEditPlusPipeline with our processor, the reference's VAE area the image's (the family's rendering
    context, as its validation images): the same image; another reference gives another image."""
    from diffusers import QwenImageEditPlusPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as module

    from xeonsd.families import by_name
    from xeonsd.families.qwenimage_edit.processor import VisionProcessor

    size = ["--height", "64", "--width", "64"]
    first = _generate(qwen_edit, tmp_path / "a", "--image", str(refs[0]), *size)
    second = _generate(qwen_edit, tmp_path / "b", "--image", str(refs[1]), *size)
    pipe = QwenImageEditPlusPipeline.from_pretrained(qwen_edit, processor=VisionProcessor.from_pretrained(qwen_edit))
    spec = by_name("qwenimage_edit")
    with mock.patch.object(module, "VAE_IMAGE_SIZE", 64 * 64):
        theirs = _diffusers(
            pipe,
            image=Image.open(refs[0]).convert("RGB"),
            height=64,
            width=64,
            true_cfg_scale=spec.guidance_scale,
            max_sequence_length=spec.prompt_length_of(qwen_edit),
        )
    gap, moved = float(np.abs(first - theirs).max()), np.abs(first - second)
    print(
        f"\nQwen-Image-Edit max |dpixel| to diffusers: {gap}; another reference moves it {moved.mean():.2f} on "
        f"average, {moved.max():.0f} at most"
    )
    assert gap == 0.0
    # the tiny random model reads a reference weakly (a fraction of a level on average), but it reads it
    assert moved.max() >= 2 and (moved > 0).mean() > 0.05


def test_what_the_torch_engine_cannot_do_is_refused_in_one_line(
    kontext: Path, qwen_edit: Path, refs: list[Path], tmp_path: Path, capsys
):
    from xeonsd.families import by_name
    from xeonsd.openvino.generate import GenerateError, GenerateOptions, check_references

    out = ["--out", str(tmp_path / "o")]
    line = cli_error(["generate", str(kontext), "--engine", "openvino", *out], capsys)
    assert "optimum-intel has no OpenVINO export for FLUX.1 Kontext" in line and "--engine torch" in line
    line = cli_error(["generate", str(kontext), "--image", str(refs[0]), "--image", str(refs[1]), *out], capsys)
    assert "--image given 2 times: FLUX.1 Kontext takes at most 1 reference image(s)" in line
    line = cli_error(["generate", str(qwen_edit), *out], capsys)
    assert "Qwen-Image-Edit-2511 edits reference images: give one with --image PATH (up to 3)" in line
    assert not (tmp_path / "o").exists()
    with pytest.raises(GenerateError, match="FLUX.1 takes no reference images"):
        check_references(GenerateOptions(references=(refs[0],), engine="torch"), by_name("flux"))
    with pytest.raises(GenerateError, match="--engine genai makes images from text only"):
        check_references(GenerateOptions(references=(refs[0],), engine="genai"), by_name("flux2"))


def test_krea2_runs_on_torch_and_turbo_gets_its_own_guidance(tmp_path: Path):
    """Krea 2 (no export) makes its image on the torch engine; a Turbo checkpoint (``is_distilled``) gets the
    guidance its validation images use (0), RAW the family's (4.5)."""
    import shutil

    from xeonsd.assets import make_tiny_model
    from xeonsd.openvino.generate import GenerateOptions, resolve_engine

    raw = make_tiny_model(tmp_path / "tiny-krea2", arch="tiny-krea2")
    turbo = tmp_path / "turbo"
    shutil.copytree(raw, turbo)
    index = json.loads((turbo / "model_index.json").read_text())
    (turbo / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    for model, want in ((raw, None), (turbo, 0.0)):
        opts, manifest = resolve_engine(model, GenerateOptions(engine="auto"))
        assert (opts.engine, manifest["guidance_scale"]) == ("torch", want), model
    image = _generate(turbo, tmp_path / "images", "--height", "64", "--width", "64")
    assert image.shape == (64, 64, 3)
