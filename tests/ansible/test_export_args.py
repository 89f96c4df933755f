"""The openvino_export role's `xeonsd export` settings (plugins/filter/xeonsd_export.py): the flags the command gets,
which the real `xeonsd export` parser accepts and reads back as the settings, and the name of the base model's
kept export, which changes with every setting that changes the exported model (and stays as it was for the
defaults, so exports kept before a setting existed are still reused). Then the role itself, run on this machine
with a stand-in for xeonsd: the inventory's quantization reaches the command, the export lands under its key, and
a second run changes nothing; the generation's guidance and negative prompt reach xeonsd generate."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from repo_code import ansible_code, changed, local_playbook

xeonsd_export = ansible_code("xeonsd_export")
export_args, export_key, ExportSettingsError = (
    xeonsd_export.export_args,
    xeonsd_export.export_key,
    xeonsd_export.ExportSettingsError,
)

# The role's defaults (roles/openvino_export/defaults/main.yml) for a run trained at 512 px.
DEFAULTS = {
    "batch_size": 5,
    "num_images_per_prompt": 1,
    "height": "auto",
    "width": "auto",
    "resolution": 512,
    "weight_format": "auto",
    "quantize": "none",
    "calibration_samples": "",
    "tome": 0,
    "tome_mlp": False,
}


def parsed(settings: dict):
    """The flags as `xeonsd export` parses them, with the quantization options it would build from them."""
    from xeonsd.cli import build_parser
    from xeonsd.openvino.export import quantize_options
    from xeonsd.openvino.quantize import check_options

    args = build_parser().parse_args(["export", "SRC", "OUT", *export_args(settings)])
    quantize = quantize_options(args)
    if quantize is not None:
        check_options(quantize, args.weight_format)  # xeonsd export's own refusal of a wrong combination
    return args, quantize


def test_the_defaults_make_the_same_flags_and_export_name_as_before() -> None:
    # a table: each flag beside its value (ruff would put one item per line)
    assert export_args(DEFAULTS) == [
        "--batch-size", "5", "--num-images-per-prompt", "1", "--height", "512", "--width", "512",
        "--weight-format", "fp32", "--tome", "0",
    ]  # fmt: skip
    assert export_key(DEFAULTS, "0123abcd") == "0123abcd-5x1-512x512-fp32"
    assert export_key({**DEFAULTS, "tome": 0.5}, "0123abcd") == "0123abcd-5x1-512x512-fp32-tome0.5"
    assert export_key({**DEFAULTS, "height": 768, "weight_format": "int8"}, "f") == "f-5x1-512x768-int8"
    args, quantize = parsed(DEFAULTS)
    assert (args.weight_format, quantize, args.tome, args.tome_mlp) == ("fp32", None, "0", False)


@pytest.mark.parametrize("method", ["hybrid", "hybrid-compact"])
def test_quantize_reaches_xeonsd_export_with_int8_weights_and_names_its_export(method: str) -> None:
    settings = {**DEFAULTS, "quantize": method}
    args, quantize = parsed(settings)
    assert args.quantize == method and args.weight_format == "int8" and quantize.method == method
    assert quantize.samples == 100  # xeonsd's default: the flag is left out
    assert export_key(settings, "f") == f"f-5x1-512x512-int8-{method}"
    args, quantize = parsed({**settings, "calibration_samples": 20, "weight_format": "int8"})
    assert quantize.samples == 20 and export_key({**settings, "calibration_samples": 20}, "f").endswith("-cal20")


def test_every_setting_that_changes_the_export_changes_its_name() -> None:
    changes = [
        {},
        {"batch_size": 1},
        {"num_images_per_prompt": 2},
        {"height": 768},
        {"width": 768},
        {"resolution": 1024},
        {"weight_format": "fp16"},
        {"weight_format": "int8"},
        {"quantize": "hybrid"},
        {"quantize": "hybrid-compact"},
        {"quantize": "hybrid", "calibration_samples": 20},
        {"tome": 0.5},
        {"tome": 0.25},
        {"tome": 0.5, "tome_mlp": True},
    ]
    keys = [export_key({**DEFAULTS, **c}, "f") for c in changes]
    assert len(set(keys)) == len(keys), keys
    for change in changes:
        parsed({**DEFAULTS, **change})  # and each is a command xeonsd export takes
    assert parsed({**DEFAULTS, "tome": "0.50", "tome_mlp": "true"})[0].tome_mlp


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"quantize": "hybrid", "weight_format": "fp16"}, "Fix: set openvino_export_weight_format to auto"),
        ({"calibration_samples": 20}, "openvino_export_calibration_samples is set but openvino_export_quantize is"),
        ({"tome_mlp": True}, "Fix: set openvino_export_tome above 0"),
        ({"resolution": ""}, "openvino_export_height is auto but the run recorded no resolution"),
        ({"weight_format": "bf16"}, "choose auto, fp32, fp16, int8"),
        ({"tome": "half"}, "set it to a number in"),
    ],
)
def test_settings_xeonsd_export_would_refuse_are_refused_naming_the_variable(change: dict, message: str) -> None:
    with pytest.raises(ExportSettingsError, match=message):
        export_args({**DEFAULTS, **change})


# A stand-in for the mpi role's wrapper + xeonsd: records each command, makes what the role then looks for.
FAKE_XEONSD = """#!/bin/bash
shift 2  # --no-preload xeonsd
printf '%s\\n' "$(python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$@")" >> "$(dirname "$0")/calls"
if [ "$1" = export ]; then mkdir -p "$3" && echo '{}' > "$3/xeonsd_export.json"; fi
if [ "$1" = generate ]; then
  while [ $# -gt 0 ]; do [ "$1" = --out ] && out="$2"; shift; done
  mkdir -p "$out" && echo '{}' > "$out/timings.json" && echo png > "$out/image_0.png"
fi
"""


def test_the_role_exports_with_the_inventorys_quantization_under_its_key_once(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    summary = {
        "method": "lora",
        "base_model": "/m/tiny",
        "base_model_fingerprint": "0123abcd",
        "resolution": 64,
        "result": {"path": "pytorch_lora_weights.safetensors"},
    }
    (run / "train_summary.json").write_text(json.dumps(summary))
    wrapper = tmp_path / "run"
    wrapper.write_text(FAKE_XEONSD)
    wrapper.chmod(0o755)
    play = [{"hosts": "localhost", "gather_facts": False, "roles": ["xeonsd.cluster.openvino_export"]}]
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play))
    extra = {
        "ansible_become": False,  # this machine's account runs the stand-in (no sudo here)
        "ansible_python_interpreter": sys.executable,
        "cluster_user": "root",
        "openvino_export_run_dir": str(run),
        "controller_runs_dir": str(tmp_path / "controller"),
        "openvino_export_env_wrapper": str(wrapper),
        "cluster_user_home": str(tmp_path / "home"),
        "finetune_resolution": "auto",
        "finetune_placeholder_token": "<dicoo>",
        "finetune_initializer_token": "toy",
        "finetune_seed": 7,
        "openvino_export_quantize": "hybrid",
        "openvino_export_calibration_samples": 8,
        "openvino_export_negative_prompt": "blurry, low quality",
        "openvino_export_guidance_scale": 6.0,
        "openvino_export_precision": "f32",
    }
    assert changed(local_playbook(tmp_path / "play.yml", extra)) > 0
    export, generate, before = [json.loads(line) for line in (tmp_path / "calls").read_text().splitlines()]
    out = tmp_path / "home" / "openvino-base" / "0123abcd-5x1-64x64-int8-hybrid-cal8"
    assert export[:3] == ["export", "/m/tiny", str(out)], export
    assert export[3:] == export_args({**DEFAULTS, "resolution": 64, "quantize": "hybrid", "calibration_samples": 8})
    assert generate[:2] == ["generate", str(out)] and (run / "openvino").resolve() == out
    from xeonsd.cli import build_parser

    gen = build_parser().parse_args(generate)  # the generate flags, as xeonsd generate reads them
    assert (gen.guidance_scale, gen.negative_prompt, gen.seed) == (6.0, "blurry, low quality", 7), generate
    assert gen.precision == "f32", generate
    assert gen.lora == [f"{run}/pytorch_lora_weights.safetensors:1.0"], generate
    # The before row: the same export, seed and flags, without the LoRA, the concept's token as its initializer word
    base = build_parser().parse_args(before)
    assert before[:2] == ["generate", str(out)] and base.lora is None and base.out == run / "images" / "before"
    assert (base.guidance_scale, base.negative_prompt, base.seed, base.precision) == (
        6.0,
        "blurry, low quality",
        7,
        "f32",
    )
    assert (gen.prompt, base.prompt) == (["a yellow <dicoo> robot at the beach, high quality"],
                                         ["a yellow toy robot at the beach, high quality"])  # fmt: skip
    assert (tmp_path / "controller" / "r1" / "images" / "before" / "timings.json").exists()
    assert (tmp_path / "controller" / "r1" / "openvino" / "xeonsd_export.json").exists()
    assert changed(local_playbook(tmp_path / "play.yml", extra)) == 0
    assert len((tmp_path / "calls").read_text().splitlines()) == 3  # all kept: nothing ran again


def test_a_family_without_an_openvino_export_skips_it_and_generates_with_torch(tmp_path: Path) -> None:
    """A Qwen-Image-Edit LoRA run (optimum-intel has no export for it): no export, no link, no manifest fetched;
    `xeonsd generate BASE --engine torch` with the export's shape, the LoRA and the run's reference image; a second
    run changes nothing; check mode runs through first."""
    generate_shape_args = xeonsd_export.generate_shape_args
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    summary = {
        "method": "lora",
        "family": "qwenimage_edit",
        "base_model": "/m/tiny-edit",
        "base_model_fingerprint": "0123abcd",
        "resolution": 64,
        "result": {"path": "pytorch_lora_weights.safetensors"},
        "sample_references": ["/data/ref/p0.png"],
    }
    (run / "train_summary.json").write_text(json.dumps(summary))
    wrapper = tmp_path / "run"
    wrapper.write_text(FAKE_XEONSD)
    wrapper.chmod(0o755)
    play = [{"hosts": "localhost", "gather_facts": False, "roles": ["xeonsd.cluster.openvino_export"]}]
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play))
    extra = {
        "ansible_become": False,
        "ansible_python_interpreter": sys.executable,
        "cluster_user": "root",
        "openvino_export_run_dir": str(run),
        "controller_runs_dir": str(tmp_path / "controller"),
        "openvino_export_env_wrapper": str(wrapper),
        "cluster_user_home": str(tmp_path / "home"),
        "finetune_resolution": "auto",
        "finetune_placeholder_token": "<dicoo>",
        "finetune_seed": 7,
    }
    check = local_playbook(tmp_path / "play.yml", extra, "--check")  # check mode runs through, running nothing
    assert check.returncode == 0 and not (tmp_path / "calls").exists(), check.stdout[-3000:]
    assert changed(local_playbook(tmp_path / "play.yml", extra)) > 0
    generate, before = [json.loads(line) for line in (tmp_path / "calls").read_text().splitlines()]
    assert generate[:2] == ["generate", "/m/tiny-edit"] and before[:2] == generate[:2], (generate, before)
    from xeonsd.cli import build_parser

    gen = build_parser().parse_args(generate)
    assert (gen.engine, gen.batch_size, gen.height, gen.width) == ("torch", 5, 64, 64), generate
    assert generate_shape_args({**DEFAULTS, "resolution": 64})[1::2] == ["5", "64", "64"]
    assert gen.lora == [f"{run}/pytorch_lora_weights.safetensors:1.0"] and gen.image == ["/data/ref/p0.png"]
    base = build_parser().parse_args(before)  # the before row: the same engine, shape and reference, no LoRA
    assert (base.engine, base.height, base.lora, base.image) == ("torch", 64, None, ["/data/ref/p0.png"]), before
    assert not (run / "openvino").exists() and not (tmp_path / "home" / "openvino-base").exists()
    assert (tmp_path / "controller" / "r1" / "images" / "timings.json").exists()
    assert not (tmp_path / "controller" / "r1" / "openvino").exists()
    assert changed(local_playbook(tmp_path / "play.yml", extra)) == 0
