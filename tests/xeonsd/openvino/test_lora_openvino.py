"""LoRA with OpenVINO on the tiny model: the trainer's adapter through GenAI at generation time (no re-export), fused
into an export, and in diffusers PyTorch give the same images; adapters blend; what GenAI cannot apply or what was
made for another base model is refused before any model is compiled. (A full fine-tune's pipeline exporting:
tests/cluster/test_finetune_methods.py.)

Images are compared as uint8 pixels (0..255): "mean" is the mean absolute difference over all pixels.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_runs import method_args, train
from ov_assets import BATCH, SIZE, STEPS, as_array, peft_adapter, torch_images

from xeonsd import cli
from xeonsd.openvino import lora_files as loraformat
from xeonsd.openvino.generate import GenerateError, GenerateOptions, generate
from xeonsd.openvino.manifest import MANIFEST

LORA_FILE = "pytorch_lora_weights.safetensors"
PROMPT = "a photo of toy"
SEED = 5


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _layout_of(path: Path) -> str:
    """``diffusers`` or ``kohya``: the layout of an adapter file (kohya's names lose the modules' dots)."""
    from xeonsd.modelfiles.lora_layout import read_adapter

    return "kohya" if all(m.module is None for m in read_adapter(path).values()) else "diffusers"


def _train_lora(tiny_model: Path, dataset: Path, out: Path, env: dict[str, str], *extra: str) -> Path:
    """``xeonsd train --method lora`` for 3 steps with a large learning rate, UNet and text encoder adapters."""
    args = method_args(
        "lora",
        tiny_model,
        dataset,
        out,
        f"--instance_prompt={PROMPT}",
        "--rank=2",
        "--train_text_encoder",
        "--learning_rate=5e-2",
        *extra,
        steps=3,
    )
    train(args, env)
    return out / LORA_FILE


@pytest.fixture(scope="module")
def trained_lora(tiny_model: Path, dataset: Path, tmp_path_factory: pytest.TempPathFactory, cli_env_module) -> Path:
    """The adapter in the diffusers layout (the trainer's default)."""
    return _train_lora(tiny_model, dataset, tmp_path_factory.mktemp("lora") / "a", cli_env_module)


@pytest.fixture(scope="module")
def trained_kohya(tiny_model: Path, dataset: Path, tmp_path_factory: pytest.TempPathFactory, cli_env_module) -> Path:
    """The same run as ``trained_lora`` with ``--save_format kohya``: the same adapter in the kohya layout."""
    out = tmp_path_factory.mktemp("lora") / "kohya"
    return _train_lora(tiny_model, dataset, out, cli_env_module, "--save_format=kohya")


@pytest.fixture(scope="module")
def cli_env_module() -> dict[str, str]:
    """``cli_env`` for module fixtures."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def second_lora(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(tiny_model / "unet")
    return peft_adapter(unet, tmp_path_factory.mktemp("lora") / "b", ["to_k", "to_v", "ff.net.2"], seed=1, scale=0.5)


@pytest.fixture(scope="module")
def ov_fused(tiny_model: Path, trained_lora: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ov_assets import _export

    return _export(tiny_model, tmp_path_factory.mktemp("ov") / "fused", lora=trained_lora, lora_scale=1.0)


def _images(ov_dir: Path, engine: str = "genai", loras: tuple = ()) -> np.ndarray:
    opts = GenerateOptions(prompts=(PROMPT,), num_images=BATCH, steps=STEPS, seed=SEED, engine=engine, loras=loras)
    images, _ = generate(ov_dir, opts)
    return as_array(images)


@pytest.fixture(scope="module")
def no_adapter(ov_base: Path) -> np.ndarray:
    return _images(ov_base)


def test_trainer_adapter_is_applied_by_genai_without_unused_tensors(
    ov_base: Path, trained_lora: Path, no_adapter: np.ndarray, capfd: pytest.CaptureFixture[str]
) -> None:
    """The trainer's file as it is: GenAI ignores it (the control, proving the warning is captured); converted by
    ``generate --lora``: no warning, the image changes, and the user's file is untouched."""
    import openvino_genai

    before = _sha256(trained_lora)
    pipe = openvino_genai.Text2ImagePipeline(str(ov_base))
    pipe.reshape(BATCH, SIZE, SIZE, 7.5)
    pipe.compile("CPU", adapters=openvino_genai.AdapterConfig([(openvino_genai.Adapter(str(trained_lora)), 1.0)]))
    del pipe
    captured = capfd.readouterr()
    assert "Unused LoRA tensor: lora_unet.unet.down_blocks.0" in captured.out + captured.err

    with_adapter = _images(ov_base, loras=((trained_lora, 1.0),))
    captured = capfd.readouterr()
    assert "Unused LoRA" not in captured.out + captured.err and "unused LoRA" not in captured.out + captured.err
    assert np.abs(with_adapter - no_adapter).mean() > 5.0
    assert _sha256(trained_lora) == before


def test_genai_adapter_fused_export_and_diffusers_agree(
    tiny_model: Path, trained_lora: Path, ov_base: Path, ov_fused: Path, no_adapter: np.ndarray
) -> None:
    """Same seed, scheduler and adapter (UNet + text encoder): diffusers PyTorch with ``load_lora_weights``, the
    fused export (optimum engine) and GenAI's adapter on the base export. Tolerance: mean < 1.5 and every image
    within 3.0 of PyTorch. Measured on the 2-core Xeon (openvino-genai 2026.4.1): GenAI adapter 0.49, fused export
    0.00 (< 0.0005); the adapter itself moves the images by more than 5 (asserted, printed)."""
    reference = _diffusers_images(tiny_model, trained_lora)
    genai = _images(ov_base, loras=((trained_lora, 1.0),))
    fused = _images(ov_fused, engine="optimum")
    figures = {}
    for name, images in (("genai adapter", genai), ("fused export", fused)):
        per_image = np.abs(images - reference).mean(axis=(1, 2, 3))
        figures[name] = round(float(per_image.mean()), 3)
        assert per_image.mean() < 1.5 and per_image.max() < 3.0, (name, per_image)
    figures["no adapter (genai)"] = round(float(np.abs(reference - no_adapter).mean()), 3)
    print("mean abs pixel difference to diffusers PyTorch + load_lora_weights:", figures)
    assert figures["no adapter (genai)"] > 5.0, "the adapter must matter for this comparison to mean anything"

    manifest = json.loads((ov_fused / MANIFEST).read_text())
    assert manifest["lora"] == {"file": str(trained_lora), "scale": 1.0, "sha256": _sha256(trained_lora)}
    base = json.loads((ov_base / MANIFEST).read_text())
    assert base["lora"] is None and base["source_fingerprint"] == manifest["source_fingerprint"]


def _diffusers_images(tiny_model: Path, lora: Path) -> np.ndarray:
    """Stock diffusers PyTorch with ``load_lora_weights(lora)``: the images as uint8 levels."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    return torch_images(pipe, PROMPT, SEED)


def test_the_kohya_file_gives_the_diffusers_files_images_in_diffusers_and_genai(
    tiny_model: Path, ov_base: Path, trained_lora: Path, trained_kohya: Path, no_adapter: np.ndarray
) -> None:
    """``--save_format kohya``: only kohya keys (with an alpha per module, the rank's here); stock diffusers'
    ``load_lora_weights`` and GenAI (``generate --lora``) each give the diffusers-format file's images. Measured on
    the 2-core Xeon: diffusers 0.000 levels apart, GenAI identical (both become the same kohya file)."""
    from safetensors import safe_open

    with safe_open(str(trained_kohya), framework="np") as fh:
        keys, meta = list(fh.keys()), fh.metadata()  # noqa: SIM118 - safe_open is not a dict
        alpha = float(fh.get_tensor("lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.alpha"))
    assert all(k.startswith(("lora_unet_", "lora_te_")) for k in keys), keys[:3]
    assert any(k.startswith("lora_te_text_model_encoder_layers_0_self_attn_q_proj.") for k in keys)
    assert alpha == 2.0 and (meta["ss_network_dim"], meta["ss_network_alpha"]) == ("2", "2")
    assert sum(k.endswith(".alpha") for k in keys) * 3 == len(keys)
    diffusers_diff = np.abs(_diffusers_images(tiny_model, trained_kohya) - _diffusers_images(tiny_model, trained_lora))
    genai_kohya = _images(ov_base, loras=((trained_kohya, 1.0),))
    genai_diff = np.abs(genai_kohya - _images(ov_base, loras=((trained_lora, 1.0),)))
    print(f"\nkohya vs diffusers file: diffusers {diffusers_diff.mean():.4f}, genai {genai_diff.mean():.4f} levels")
    assert diffusers_diff.mean() < 0.05 and diffusers_diff.max() <= 1.0
    assert genai_diff.max() == 0.0
    assert np.abs(genai_kohya - no_adapter).mean() > 5.0  # and it is applied


def test_kohya_and_diffusers_layouts_convert_both_ways(
    tiny_model: Path, trained_lora: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """diffusers -> kohya -> diffusers gives each module's up x down x alpha/rank back (alpha folded into up); a
    kohya module the model lacks is named, by write_diffusers and by ``export --lora`` alike."""
    from diffusers import StableDiffusionPipeline

    from xeonsd.modelfiles import lora_layout

    pipe = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None, requires_safety_checker=False)
    names = lora_layout.module_names(pipe.unet, pipe.text_encoder)
    kohya = lora_layout.convert(trained_lora, tmp_path / "k.safetensors", "kohya")
    assert _layout_of(kohya) == "kohya" and _layout_of(trained_lora) == "diffusers"
    back = lora_layout.convert(kohya, tmp_path / "d.safetensors", "diffusers", names)
    original, again = lora_layout.read_adapter(trained_lora), lora_layout.read_adapter(back)
    assert again.keys() == original.keys() and _layout_of(back) == "diffusers"
    for name, mod in original.items():
        delta = (mod.up @ mod.down) * mod.scale
        assert np.allclose((again[name].up @ again[name].down) * again[name].scale, delta, atol=1e-6), name
        assert again[name].module == mod.module
    # a kohya file with modules this model does not have
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(kohya))
    for part in ("lora_down.weight", "lora_up.weight", "alpha"):
        tensors[f"lora_unet_mid_block_attentions_7_proj_in.{part}"] = tensors[
            f"lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.{part}"
        ]
    save_file(tensors, str(tmp_path / "bad.safetensors"))
    with pytest.raises(
        lora_layout.LoraFormatError, match="modules the model lacks: lora_unet_mid_block_attentions_7_proj_in"
    ):
        lora_layout.convert(tmp_path / "bad.safetensors", tmp_path / "x.safetensors", "diffusers", names)
    bad = ["export", str(tiny_model), str(tmp_path / "ov"), "--lora", str(tmp_path / "bad.safetensors")]
    err = _cli_error(bad, capsys)
    assert "was made for another base model than the source" in err
    assert "that model has no module lora_unet_mid_block_attentions_7_proj_in" in err
    assert not (tmp_path / "ov").exists()


def test_two_adapters_blend(
    ov_base: Path, trained_lora: Path, second_lora: Path, no_adapter: np.ndarray, tmp_path: Path
) -> None:
    """Two adapters at once differ from each alone and from none; alpha 0 is no adapter (through the CLI)."""
    a = _images(ov_base, loras=((trained_lora, 1.0),))
    b = _images(ov_base, loras=((second_lora, 1.0),))
    both = _images(ov_base, loras=((trained_lora, 1.0), (second_lora, 1.0)))
    for name, other in (("a", a), ("b", b), ("none", no_adapter)):
        assert np.abs(both - other).mean() > 3.0, name
    assert np.abs(b - no_adapter).mean() > 3.0

    out = tmp_path / "images"
    args = ["generate", str(ov_base), "--prompt", PROMPT, "--num-images", str(BATCH), "--steps", str(STEPS)]
    args += ["--seed", str(SEED), "--lora", f"{trained_lora}:0", "--lora", f"{second_lora}:0", "--out", str(out)]
    assert cli.main(args) == 0
    import openvino as ov
    from PIL import Image

    zero = as_array([Image.open(out / f"image_{i:03d}.png") for i in range(BATCH)])
    diff = np.abs(zero - no_adapter)
    # Where the CPU infers in bf16 (AVX512-BF16, AMX) the adapters' zero-weighted ops change the rounding (a mean of
    # 0.75 levels, single pixels by 12, measured on an AMD EPYC with AVX512-BF16); it stays a small fraction of
    # what one adapter does.
    effect = np.abs(a - no_adapter).mean()
    print(f"\nmean abs pixel difference to no adapter: alpha 0 {diff.mean():.3f}, adapter a {effect:.3f}")
    assert diff.mean() < effect / 10, (diff.mean(), effect)
    if ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT") == ov.Type.f32:
        assert diff.max() <= 1.0


# --- refused, before anything is compiled -----------------------------------------------------------------------


def _cli_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("xeonsd ")]  # beside diffusers' progress bars
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err
    return lines[0]


def test_adapter_for_another_base_model_is_refused(
    tiny_model: Path, ov_base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An adapter trained on a UNet whose cross-attention takes 48-wide text features (as SD 2.x's 1024 against SD
    1.x's 768): generate and export both refuse it, naming the adapter, the model and the module."""
    from diffusers import UNet2DConditionModel

    config = dict(UNet2DConditionModel.load_config(tiny_model / "unet"), cross_attention_dim=48)
    other = peft_adapter(UNet2DConditionModel.from_config(config), tmp_path / "other", ["to_k"], seed=2, scale=0.1)
    err = _cli_error(["generate", str(ov_base), "--lora", str(other), "--out", str(tmp_path / "o")], capsys)
    assert f"LoRA file {other} was made for another base model than {ov_base} (exported from {tiny_model})" in err
    assert "attn2.to_k is 32x32 there, the adapter expects 32x48" in err
    err = _cli_error(["export", str(tiny_model), str(tmp_path / "ov"), "--lora", str(other)], capsys)
    assert f"{other} was made for another base model than the source {tiny_model}" in err and "32x48" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]


def test_adapter_on_3x3_convolutions_is_refused_for_genai(
    tiny_model: Path, ov_base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(tiny_model / "unet")
    convs = peft_adapter(unet, tmp_path / "convs", ["to_q", "conv1"], seed=3, scale=0.1)
    err = _cli_error(["generate", str(ov_base), "--lora", f"{convs}:0.5", "--out", str(tmp_path / "o")], capsys)
    assert "non-pointwise convolutions, which OpenVINO GenAI cannot apply" in err
    assert "unet.down_blocks.0.resnets.0.conv1 (3x3)" in err and f"xeonsd export SRC OUT --lora {convs}" in err


def test_optimum_engine_points_at_the_fused_export(ov_base: Path, tmp_path: Path, capsys) -> None:
    lora = tmp_path / "a.safetensors"
    lora.write_bytes(b"")
    args = ["generate", str(ov_base), "--engine", "optimum", "--lora", str(lora), "--out", str(tmp_path / "o")]
    err = _cli_error(args, capsys)
    assert "--engine optimum has no runtime LoRA" in err and f"xeonsd export SRC OUT --lora {lora}" in err
    with pytest.raises(GenerateError, match="LoRA file .*missing.safetensors does not exist"):
        generate(ov_base, GenerateOptions(engine="genai", loras=((tmp_path / "missing.safetensors", 1.0),)))


def test_lora_spec_parsing_and_kohya_conversion(trained_lora: Path, tmp_path: Path) -> None:
    assert loraformat.parse_spec("a.safetensors") == (Path("a.safetensors"), 1.0)
    assert loraformat.parse_spec("/x/a.safetensors:0.6") == (Path("/x/a.safetensors"), 0.6)
    assert loraformat.parse_spec("C:a.safetensors") == (Path("C:a.safetensors"), 1.0)
    out = loraformat.convert_for_genai(trained_lora, tmp_path / "k.safetensors")
    from safetensors.numpy import load_file

    kohya = load_file(str(out))
    name = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    assert kohya[f"{name}.lora_down.weight"].shape == (2, 32) and float(kohya[f"{name}.alpha"]) == 2.0
    assert any(k.startswith("lora_te_text_model_encoder_layers_0_self_attn_q_proj.") for k in kohya)
    # a kohya file reads back to the same modules
    again = loraformat.read_adapter(out)
    assert again.keys() == loraformat.read_adapter(trained_lora).keys()
