"""``xeonsd export`` on the tiny model: both kinds of source, the recipe's static shape, int8, and bad input."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
import torch
from cli_runs import run_cli
from ov_assets import BATCH, PROMPT, SIZE, STEPS, TOKEN, as_array
from safetensors.torch import save_file

from xeonsd import cli
from xeonsd.modelfiles.concept_file import ov_vocab_rows
from xeonsd.openvino.manifest import MANIFEST

TOKENS = [TOKEN, f"{TOKEN}_1"]


def _input_shape(xml: Path) -> ov.PartialShape:
    return ov.Core().read_model(xml).inputs[0].get_partial_shape()


def test_export_from_base_and_embeds_bakes_the_concept_in(ov_baked: Path, tiny_model: Path) -> None:
    from transformers import CLIPTokenizer

    manifest = json.loads((ov_baked / MANIFEST).read_text())
    assert manifest["concept_tokens"] == TOKENS
    assert manifest["static_shape"] == {"batch_size": BATCH, "height": SIZE, "width": SIZE, "num_images_per_prompt": 1}
    assert manifest["weight_format"] == "fp32"
    assert manifest["versions"]["openvino"] and manifest["versions"]["optimum-intel"] == "2.2.0"
    base = CLIPTokenizer.from_pretrained(tiny_model / "tokenizer")
    tok = CLIPTokenizer.from_pretrained(ov_baked / "tokenizer")
    assert tok.convert_tokens_to_ids(TOKENS) == [len(base), len(base) + 1]
    te = ov.Core().read_model(ov_baked / "text_encoder" / "openvino_model.xml")
    assert ov_vocab_rows(te) == len(base) + 2 == manifest["vocab_size"]
    assert (ov_baked / "tokenizer" / "openvino_tokenizer.xml").is_file()


def test_static_export_has_the_recipe_shape_in_every_network(ov_baked: Path) -> None:
    latent = SIZE // 8
    assert _input_shape(ov_baked / "unet" / "openvino_model.xml") == ov.PartialShape([2 * BATCH, 4, latent, latent])
    assert _input_shape(ov_baked / "text_encoder" / "openvino_model.xml") == ov.PartialShape([BATCH, 77])
    # optimum-intel alone leaves the decoder at num_images_per_prompt (1); 5 prompts then fail in the VAE.
    assert _input_shape(ov_baked / "vae_decoder" / "openvino_model.xml") == ov.PartialShape([BATCH, 4, latent, latent])


def test_recipe_call_on_the_export_makes_five_distinct_images(ov_baked: Path) -> None:
    """The recipe's calls on the loaded export: 5 prompts in one call -> 5 images, each from its own noise."""
    from optimum.intel import OVStableDiffusionPipeline

    pipe = OVStableDiffusionPipeline.from_pretrained(ov_baked, dynamic_shapes=False)
    assert (pipe.batch_size, pipe.height, pipe.width) == (2 * BATCH, SIZE, SIZE)
    result = pipe(prompt=[PROMPT] * BATCH, num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0))
    images = as_array(result.images)
    assert images.shape == (BATCH, SIZE, SIZE, 3)
    for i in range(BATCH):
        for j in range(i + 1, BATCH):
            assert np.abs(images[i] - images[j]).mean() > 5.0, f"images {i} and {j} are the same"


def test_export_from_full_pipeline_finds_its_concept_and_stays_dynamic(ov_full_dynamic: Path) -> None:
    from optimum.intel import OVStableDiffusionPipeline

    manifest = json.loads((ov_full_dynamic / MANIFEST).read_text())
    assert manifest["concept_tokens"] == TOKENS and manifest["static_shape"] is None
    assert _input_shape(ov_full_dynamic / "unet" / "openvino_model.xml").is_dynamic
    assert OVStableDiffusionPipeline.from_pretrained(ov_full_dynamic, compile=False).height == -1


def test_an_fp32_export_keeps_fp32_weights_in_a_network_of_any_size(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unasked, optimum compresses the weights of every network of 1 B parameters or more to int8 (SDXL's UNet has
    2.6 B): an fp32 export must not. Its threshold at one parameter makes every network of the tiny model that big."""
    import optimum.exporters.openvino.__main__ as optimum_export

    from xeonsd.openvino.export import ExportOptions, export

    monkeypatch.setattr(optimum_export, "_MAX_UNCOMPRESSED_SIZE", 1)
    out = export(str(tiny_model), tmp_path / "fp32", ExportOptions(static=None))
    assert json.loads((out / MANIFEST).read_text())["weight_format"] == "fp32"
    for net in ("unet", "text_encoder", "vae_decoder"):
        model = ov.Core().read_model(out / net / "openvino_model.xml")
        types = {op.get_element_type().get_type_name() for op in model.get_ops() if op.get_type_name() == "Constant"}
        assert "f32" in types and not types & {"i8", "u8", "i4", "u4"}, (net, types)


def test_int8_export_and_generate_through_the_cli(
    tiny_model: Path, embeds: Path, tmp_path: Path, cli_env: dict[str, str]
) -> None:
    out = tmp_path / "int8"
    cmd = ["export", str(tiny_model), str(out), "--embeds", str(embeds)]
    cmd += ["--weight-format", "int8", "--batch-size", "2", "--height", str(SIZE), "--width", str(SIZE)]
    run = run_cli(cmd, cli_env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1])["out"] == str(out)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["weight_format"] == "int8" and manifest["concept_tokens"] == TOKENS
    unet = ov.Core().read_model(out / "unet" / "openvino_model.xml")
    weight_types = {op.get_element_type().get_type_name() for op in unet.get_ops() if op.get_type_name() == "Constant"}
    assert weight_types & {"i8", "u8"}, weight_types

    images = tmp_path / "images"
    gen = ["generate", str(out), "--num-images", "4", "--steps", "2", "--engine", "genai", "--out", str(images)]
    run = run_cli(gen, cli_env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in images.glob("image_*.png")) == [f"image_{i:03d}.png" for i in range(4)]
    timings = json.loads((images / "timings.json").read_text())
    assert timings["num_images"] == 4 and len(timings["call_latency_s"]) == 2 and timings["images_per_s"] > 0
    assert (images / "grid.png").is_file()


# --- bad input: each a clear error (exit code 2), and nothing left behind -------------------------------------


def _cli_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(args) == 2
    return capsys.readouterr().err


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir()) if parent.exists() else []


@pytest.fixture
def partial_source(tiny_model: Path, tmp_path: Path) -> Path:
    src = tmp_path / "partial"
    shutil.copytree(tiny_model, src)
    for f in (src / "unet").glob("*.safetensors"):
        f.unlink()
    return src


def test_export_refuses_a_missing_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _cli_error(["export", str(tmp_path / "nope"), str(tmp_path / "out")], capsys)
    assert f"source {tmp_path / 'nope'}: cannot be loaded: looked for as a local directory (not found)" in err
    assert _leftovers(tmp_path) == []


def test_export_refuses_a_hub_id_the_hub_cannot_serve(tmp_path: Path, capsys, monkeypatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")  # never resolves
    err = _cli_error(["export", "nope/dir", str(tmp_path / "out")], capsys)
    assert err.startswith("xeonsd export: error: source nope/dir: cannot be loaded: ") and err.count("\n") == 1
    assert "on the Hub (host hub.invalid does not resolve)" in err and "base_model role" in err
    assert _leftovers(tmp_path) == []


def test_export_refuses_a_partial_source(partial_source: Path, tmp_path: Path, capsys) -> None:
    err = _cli_error(["export", str(partial_source), str(tmp_path / "out")], capsys)
    assert "not a complete SD 1.x/2.x pipeline" in err and "unet/" in err
    (partial_source / "model_index.json").unlink()
    err = _cli_error(["export", str(partial_source), str(tmp_path / "out")], capsys)
    assert "model_index.json is missing" in err
    assert not (tmp_path / "out").exists()


def test_export_refuses_embeds_of_another_hidden_size(tiny_model: Path, tmp_path: Path, capsys) -> None:
    bad = tmp_path / "sd15_embeds.safetensors"
    save_file({TOKEN: torch.zeros(1, 768)}, str(bad))
    err = _cli_error(["export", str(tiny_model), str(tmp_path / "out"), "--embeds", str(bad)], capsys)
    assert "768" in err and "hidden size is 32" in err
    assert _leftovers(tmp_path) == [bad.name]


def test_export_refuses_a_token_that_collides(tiny_model: Path, tmp_path: Path, capsys) -> None:
    bad = tmp_path / "toy.safetensors"
    save_file({"toy": torch.zeros(1, 32)}, str(bad))
    err = _cli_error(["export", str(tiny_model), str(tmp_path / "out"), "--embeds", str(bad)], capsys)
    assert "'toy' collides with an existing token" in err
    assert _leftovers(tmp_path) == [bad.name]


def test_export_refuses_an_unwritable_output(tiny_model: Path, tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    err = _cli_error(["export", str(tiny_model), str(blocker / "out")], capsys)
    assert "is a file, not a directory" in err
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.geteuid() != 0:  # root writes anyway; the file case above covers it
            err = _cli_error(["export", str(tiny_model), str(locked / "out")], capsys)
            assert "not writable" in err
    finally:
        locked.chmod(0o700)
    assert _leftovers(locked) == []


def test_export_refuses_a_non_empty_output(tiny_model: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    err = _cli_error(["export", str(tiny_model), str(out)], capsys)
    assert "already exists and is not empty" in err
    assert _leftovers(out) == ["keep.txt"]


class _FullDisk:
    def save_pretrained(self, path: Path) -> None:
        raise RuntimeError("basic_ios::clear: iostream error")  # what OpenVINO says on ENOSPC


def test_a_full_disk_while_saving_names_the_free_space_not_an_iostream_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from xeonsd.openvino import export as export_module

    full = shutil.disk_usage(tmp_path)._replace(free=300 * 1024**2)
    monkeypatch.setattr(export_module.shutil, "disk_usage", lambda path: full)
    with pytest.raises(export_module.ExportError) as err:
        export_module.save_networks(_FullDisk(), tmp_path / "tmp", tmp_path / "out")
    said = str(err.value)
    assert f"cannot write the OpenVINO model to {tmp_path / 'out'}: the disk is full (0.3 GB free in" in said
    assert "iostream error" in said and "TMPDIR" in said
    # With room on both file systems, the failure is not the disk's: OpenVINO's own error goes through.
    monkeypatch.setattr(export_module.shutil, "disk_usage", lambda path: full._replace(free=50 * 1024**3))
    with pytest.raises(RuntimeError, match="iostream error"):
        export_module.save_networks(_FullDisk(), tmp_path / "tmp", tmp_path / "out")
