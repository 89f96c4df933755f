"""``xeonsd export --quantize hybrid`` on the tiny model: int8 UNet activations, calibrated offline on our prompts,
loadable by both engines; and its bad input refused before any work."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
from ov_assets import SIZE, TOKEN, as_array, linear_weight_types

from xeonsd import cli
from xeonsd.openvino.manifest import MANIFEST
from xeonsd.openvino.quantize import CALIBRATION_STEPS, default_prompts
from xeonsd.templates import OBJECT_TEMPLATES

CALIB_PROMPTS = ["a green <dicoo> toy on a table", "a <dicoo> in the snow"]
# More UNet calls than three pipeline calls' worth of steps less one (a scheduler may add a UNet call or two per
# pipeline call): at least three pipeline calls, so the two prompts are cycled and the first comes round again.
SAMPLES = 3 * CALIBRATION_STEPS + 1


class NetworkUsed(AssertionError):
    pass


@pytest.fixture(scope="module")
def ov_hybrid(tiny_model: Path, embeds: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """A hybrid export through the CLI, with every socket connection refused and recorded."""
    tmp = tmp_path_factory.mktemp("hybrid")
    prompts = tmp / "prompts.txt"
    prompts.write_text(f"# calibration prompts\n{CALIB_PROMPTS[0]}\n\n{CALIB_PROMPTS[1]}\n")
    attempts: list = []

    def refuse(self, address, *args, **kwargs):  # noqa: ANN001
        attempts.append(address)
        raise NetworkUsed(f"network access during export: {address}")

    out = tmp / "ov"
    argv = ["export", str(tiny_model), str(out), "--embeds", str(embeds), "--quantize", "hybrid"]
    argv += ["--calibration-prompts", str(prompts), "--calibration-samples", str(SAMPLES)]
    argv += ["--batch-size", "1", "--height", str(SIZE), "--width", str(SIZE)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", refuse)
        mp.setattr(socket.socket, "connect_ex", refuse)
        assert cli.main(argv) == 0
    return out, attempts


def test_hybrid_export_quantizes_unet_activations_calibrated_on_the_given_prompts_offline(ov_hybrid) -> None:
    out, attempts = ov_hybrid
    assert attempts == []  # no dataset download, no Hub lookup
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["weight_format"] == "int8"
    q = manifest["quantization"]
    assert q["method"] == "hybrid"
    calib = q["calibration"]
    calls = calib["pipeline_calls"]
    assert calls >= 3 and calib["samples"] == SAMPLES
    # In the file's order, cycled; the comment and the blank line skipped.
    assert calib["prompts"] == [CALIB_PROMPTS[i % 2] for i in range(calls)]
    assert (calib["height"], calib["width"]) == (SIZE, SIZE)  # at the export's static size
    core = ov.Core()
    unet = core.read_model(out / "unet" / "openvino_model.xml")
    ops = [op.get_type_name() for op in unet.get_ops()]
    assert "FakeQuantize" in ops  # int8 activations
    # The ResNet convolutions (most of the UNet's work) read int8-quantized activations.
    convs = [op for op in unet.get_ops() if op.get_type_name() == "Convolution" and "resnets" in op.get_friendly_name()]
    fed = [c.input_value(0).get_node().get_type_name() for c in convs]
    assert len(convs) >= 10 and all(t == "FakeQuantize" for t in fed), fed
    # hybrid leaves the UNet's linear layers as exported (bf16 on AMX: faster than decompressing int8 weights).
    assert linear_weight_types(out) == {"f32"}
    for name in ("unet", "text_encoder", "vae_decoder"):  # 8-bit weights in every network (the UNet's convolutions)
        model = core.read_model(out / name / "openvino_model.xml")
        types = {op.get_element_type().get_type_name() for op in model.get_ops() if op.get_type_name() == "Constant"}
        assert types & {"i8", "u8"}, (name, types)
    for name in ("text_encoder", "vae_decoder"):  # activations stay in float outside the UNet
        model = core.read_model(out / name / "openvino_model.xml")
        assert "FakeQuantize" not in {op.get_type_name() for op in model.get_ops()}, name


@pytest.mark.parametrize("engine", ["optimum", "genai"])
def test_hybrid_export_generates_in_both_engines(ov_hybrid, engine: str, tmp_path: Path) -> None:
    out, _ = ov_hybrid
    images = tmp_path / "images"
    argv = ["generate", str(out), "--engine", engine, "--num-images", "2", "--steps", "3"]
    argv += ["--prompt", f"a yellow {TOKEN} robot at the beach, high quality", "--out", str(images)]
    assert cli.main(argv) == 0
    from PIL import Image

    pixels = as_array([Image.open(images / f"image_{i:03d}.png") for i in range(2)])
    assert pixels.shape == (2, SIZE, SIZE, 3)
    assert pixels.std() > 5.0  # not a flat picture
    assert np.abs(pixels[0] - pixels[1]).mean() > 2.0  # seed 0 and seed 1 differ
    timings = json.loads((images / "timings.json").read_text())
    assert timings["engine"] == engine and timings["num_images"] == 2


def test_both_engines_make_the_same_image_from_the_hybrid_export(ov_hybrid) -> None:
    from xeonsd.openvino.generate import GenerateOptions, generate

    out, _ = ov_hybrid
    got = {}
    for engine in ("optimum", "genai"):
        opts = GenerateOptions(num_images=1, steps=3, engine=engine)
        got[engine] = as_array(generate(out, opts)[0])
    diff = np.abs(got["optimum"] - got["genai"]).mean()
    assert diff < 3.0, f"mean absolute pixel difference between engines {diff:.2f} / 255"


def test_default_calibration_prompts_are_the_recipe_prompt_and_templates_with_the_concept_token() -> None:
    prompts = default_prompts(["<cat>", "<cat>_1"])
    assert prompts[0] == "a yellow <cat> robot at the beach, high quality"
    assert prompts[1:] == [t.format("<cat>") for t in OBJECT_TEMPLATES]
    assert default_prompts([])[0] == f"a yellow {TOKEN} robot at the beach, high quality"


# --- bad input: each a clear error (exit code 2) before anything is loaded, and nothing written ----------------


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("xeonsd export: error: ") and err.count("\n") == 1, err
    return err


def test_hybrid_export_refuses_bad_calibration_input(tiny_model: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    base = ["export", str(tiny_model), str(out), "--quantize", "hybrid"]
    missing = tmp_path / "nope.txt"
    assert "--calibration-prompts " + str(missing) + " does not exist" in _error(
        [*base, "--calibration-prompts", str(missing)], capsys
    )
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n# only a comment\n")
    assert "holds no prompts" in _error([*base, "--calibration-prompts", str(empty)], capsys)
    assert "--calibration-samples must be at least 1, got 0" in _error([*base, "--calibration-samples", "0"], capsys)
    for fmt in ("fp16", "fp32"):
        err = _error([*base, "--weight-format", fmt], capsys)
        assert f"cannot be combined with --weight-format {fmt}" in err
    err = _error(["export", str(tiny_model), str(out), "--calibration-samples", "5"], capsys)
    assert "need --quantize" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]
