"""``xeonsd generate`` on tiny exports: equivalences (static/dynamic, OpenVINO/PyTorch, embeds/baked, genai/optimum)
and the requests it must refuse.

Images are compared as uint8 PNG pixels (0..255): "mean" is the mean absolute difference over all pixels.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from ov_assets import BATCH, PROMPT, SIZE, STEPS, TOKEN, as_array

from xeonsd import cli
from xeonsd.modelfiles.concept_file import expand_prompt
from xeonsd.openvino.generate import GenerateError, GenerateOptions, generate
from xeonsd.openvino.manifest import ExportDirError

OPTS = GenerateOptions(prompts=(PROMPT,), num_images=BATCH, steps=STEPS, seed=11)


def _images(ov_dir: Path, **changes) -> np.ndarray:
    opts = GenerateOptions(**{**OPTS.__dict__, **changes})
    images, timings = generate(ov_dir, opts)
    assert timings["num_images"] == len(images) == opts.num_images
    return as_array(images)


@pytest.fixture(scope="module")
def baked_optimum(ov_baked: Path) -> np.ndarray:
    return _images(ov_baked, engine="optimum")


def test_static_and_dynamic_exports_give_the_same_images(baked_optimum: np.ndarray, ov_full_dynamic: Path) -> None:
    """Same seed, same batch: static (base+embeds) and dynamic (full pipeline) exports agree to < 1/255 on average."""
    dynamic = _images(ov_full_dynamic, engine="optimum", height=SIZE, width=SIZE)
    diff = np.abs(baked_optimum - dynamic)
    assert diff.mean() < 1.0 and diff.max() <= 16, (diff.mean(), diff.max())


def test_openvino_matches_diffusers_pytorch(full_pipeline: Path, ov_full_dynamic: Path) -> None:
    """Same pipeline, scheduler, seed: OpenVINO fp32 vs diffusers PyTorch fp32, PSNR > 40 dB on the 0..1 images."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(full_pipeline, safety_checker=None, requires_safety_checker=False)
    result = pipe(
        prompt=[PROMPT] * BATCH,
        num_inference_steps=STEPS,
        height=SIZE,
        width=SIZE,
        generator=torch.Generator().manual_seed(OPTS.seed),
        output_type="np",
    )
    reference = result.images.astype(np.float64)
    ov_images = _images(ov_full_dynamic, engine="optimum", height=SIZE, width=SIZE) / 255.0
    mse = np.mean((reference - ov_images) ** 2)
    psnr = 10 * np.log10(1.0 / max(mse, 1e-12))
    assert psnr > 40.0, psnr


@pytest.mark.parametrize("engine", ["optimum", "genai"])
def test_embeds_loaded_at_generate_time_match_the_baked_export(
    engine: str, baked_optimum: np.ndarray, ov_base: Path, ov_baked: Path, embeds: Path
) -> None:
    loaded = _images(ov_base, engine=engine, embeds=embeds)
    baked = baked_optimum if engine == "optimum" else _images(ov_baked, engine=engine)
    assert np.abs(loaded - baked).max() <= 1.0
    # ... and the concept matters: without it the same seed gives other images.
    assert np.abs(_images(ov_base, engine=engine) - baked).mean() > 5.0


def test_genai_engine_matches_optimum(baked_optimum: np.ndarray, ov_baked: Path) -> None:
    """OpenVINO GenAI's C++ pipeline (own tokenizer model, scheduler, TorchGenerator) vs optimum-intel."""
    genai = _images(ov_baked, engine="genai")
    assert np.abs(genai - baked_optimum).mean() < 2.0


def test_genai_tokenizer_gives_the_transformers_ids_for_the_concept(ov_baked: Path) -> None:
    import openvino as ov
    import openvino_tokenizers  # noqa: F401 - registers the tokenizer operations
    from transformers import CLIPTokenizer

    tok = CLIPTokenizer.from_pretrained(ov_baked / "tokenizer")
    ov_tok = ov.compile_model(ov_baked / "tokenizer" / "openvino_tokenizer.xml", "CPU")
    for prompt in (expand_prompt(PROMPT, [TOKEN, f"{TOKEN}_1"]), "a toy,<dicoo>!", "a photo of a cat"):
        assert ov_tok([prompt])["input_ids"][0].tolist() == tok(prompt).input_ids, prompt


def test_expand_prompt_follows_diffusers_for_multi_vector_concepts(ov_baked: Path) -> None:
    from diffusers.loaders.textual_inversion import TextualInversionLoaderMixin
    from transformers import CLIPTokenizer

    tok = CLIPTokenizer.from_pretrained(ov_baked / "tokenizer")
    for prompt in (PROMPT, "a toy", f"{TOKEN} and {TOKEN}"):
        want = TextualInversionLoaderMixin().maybe_convert_prompt(prompt, tok)
        assert expand_prompt(prompt, [TOKEN, f"{TOKEN}_1"]) == want


def test_generate_cli_writes_pngs_grid_and_timings(ov_baked: Path, tmp_path: Path) -> None:
    out = tmp_path / "images"
    args = ["generate", str(ov_baked), "--engine", "optimum", "--num-images", "10", "--steps", "2", "--out", str(out)]
    assert cli.main(args) == 0
    assert len(list(out.glob("image_*.png"))) == 10
    timings = json.loads((out / "timings.json").read_text())
    assert timings["seeds"] == [0, 1] and len(timings["call_latency_s"]) == 2
    assert {"load_s", "compile_s", "first_image_s", "images_per_s"} <= timings.keys()
    from PIL import Image

    assert Image.open(out / "grid.png").size == (4 * SIZE, 3 * SIZE)


def test_precision_f32_compiles_every_network_in_f32_and_an_unknown_one_is_refused(ov_baked: Path) -> None:
    """``--precision f32`` reaches OpenVINO: each compiled network infers in f32, also on a CPU whose default is bf16
    (AMX, AVX512-BF16), where "auto" keeps the plugin's default."""
    import openvino as ov

    from xeonsd.openvino.generate import open_engine

    default = ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT")
    for precision, want in (("f32", ov.Type.f32), ("auto", default)):
        engine = open_engine(
            ov_baked, GenerateOptions(num_images=BATCH, steps=1, engine="optimum", precision=precision)
        )
        try:
            parts = [engine._pipe.text_encoder, engine._pipe.unet, engine._pipe.vae_decoder]
            assert [p.request.get_property("INFERENCE_PRECISION_HINT") for p in parts] == [want] * 3, precision
        finally:
            engine.close()
    with pytest.raises(GenerateError, match="unknown --precision 'f16'; choose one of auto, f32"):
        generate(ov_baked, GenerateOptions(num_images=BATCH, precision="f16"))


# --- requests and directories it must refuse ------------------------------------------------------------------


def _cli_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(args) == 2
    return capsys.readouterr().err


def test_refuses_a_batch_that_does_not_fit_the_static_shape(ov_baked: Path, tmp_path: Path, capsys) -> None:
    err = _cli_error(["generate", str(ov_baked), "--num-images", "3", "--out", str(tmp_path / "o")], capsys)
    assert "static batch 5 prompt(s) x 1 image(s) per prompt at 64x64" in err and "multiple of 5" in err
    err = _cli_error(["generate", str(ov_baked), "--height", "512", "--out", str(tmp_path / "o")], capsys)
    assert "--height 512 does not fit" in err and "64x64" in err
    two = ["--prompt", "a toy", "--prompt", "a dog", "--engine", "genai"]
    err = _cli_error(["generate", str(ov_baked), *two, "--out", str(tmp_path / "o")], capsys)
    assert "one prompt per call" in err
    assert not (tmp_path / "o").exists()


def test_refuses_an_ov_dir_from_a_different_export(ov_base: Path, ov_baked: Path, tmp_path: Path, capsys) -> None:
    mixed = tmp_path / "mixed"
    shutil.copytree(ov_base, mixed)
    shutil.rmtree(mixed / "text_encoder")
    shutil.copytree(ov_baked / "text_encoder", mixed / "text_encoder")
    err = _cli_error(["generate", str(mixed), "--out", str(tmp_path / "o")], capsys)
    assert "text_encoder does not match" in err and "different export" in err


def test_refuses_a_directory_that_is_not_an_export(tiny_model: Path, tmp_path: Path, capsys) -> None:
    err = _cli_error(["generate", str(tiny_model), "--out", str(tmp_path / "o")], capsys)
    assert "not an xeonsd OpenVINO export" in err and "xeonsd export" in err
    err = _cli_error(["generate", str(tmp_path / "missing"), "--out", str(tmp_path / "o")], capsys)
    assert "does not exist" in err


def test_refuses_embeds_the_export_already_holds(ov_baked: Path, embeds: Path, tmp_path: Path, capsys) -> None:
    args = ["generate", str(ov_baked), "--engine", "optimum", "--embeds", str(embeds), "--out", str(tmp_path / "o")]
    err = _cli_error(args, capsys)
    assert f"'{TOKEN}' collides with an existing token" in err
    with pytest.raises(GenerateError, match="does not exist"):
        generate(ov_baked, GenerateOptions(embeds=tmp_path / "nope.safetensors"))


def test_read_manifest_refuses_a_missing_network(ov_base: Path, tmp_path: Path) -> None:
    from xeonsd.openvino.manifest import read_manifest

    broken = tmp_path / "broken"
    shutil.copytree(ov_base, broken)
    (broken / "unet" / "openvino_model.bin").unlink()
    with pytest.raises(ExportDirError, match="incomplete: unet"):
        read_manifest(broken)


def test_a_failure_while_writing_leaves_no_output(ov_baked: Path, tmp_path: Path, monkeypatch) -> None:
    import xeonsd.openvino.generate as gen

    def broken_grid(images: list) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(gen, "make_grid", broken_grid)
    out = tmp_path / "images"
    with pytest.raises(OSError, match="disk full"):
        gen.generate_to_dir(ov_baked, out, GenerateOptions(num_images=BATCH, steps=1))
    assert list(tmp_path.iterdir()) == []
