"""DreamBooth prior preservation on the tiny model: the class images generated once and reused, the paired steps
equal over ranks, and its bad input refused before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_runs import method_args, refused, train
from PIL import Image
from safetensors.torch import load_file

LORA_FILE = "pytorch_lora_weights.safetensors"
CLASS = "--class_prompt=a photo of toy"


def prior_args(model: Path, data: Path, out: Path, class_dir: Path, *extra: str, batch: int = 1) -> list[str]:
    flags = ["--instance_prompt=a photo of sks toy", "--with_prior_preservation", CLASS]
    flags += [f"--class_data_dir={class_dir}", "--num_class_images=3", "--prior_loss_weight=0.5"]
    return method_args("lora", model, data, out, *flags, *extra, batch=batch, steps=2)


@pytest.fixture(scope="module")
def generated(tiny_model: Path, dataset: Path, tmp_path_factory: pytest.TempPathFactory, cli_env_module):
    """One run that generated the class images: (its class dir, its stderr, each image's bytes, its summary)."""
    root = tmp_path_factory.mktemp("prior")
    class_dir = root / "class"
    no_export = f"--class_export={root / 'no-exports'}"  # no OpenVINO export of the base model there: PyTorch
    proc = train(prior_args(tiny_model, dataset, root / "out", class_dir, no_export), cli_env_module)
    summary = json.loads((root / "out" / "train_summary.json").read_text())
    return class_dir, proc.stderr, {p.name: p.read_bytes() for p in sorted(class_dir.iterdir())}, summary


@pytest.fixture(scope="module")
def cli_env_module() -> dict[str, str]:
    import os
    import sys

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_missing_class_images_are_generated_once_and_kept(generated, tiny_model, dataset, tmp_path, cli_env):
    class_dir, stderr, images, _ = generated
    assert list(images) == ["class-00000.png", "class-00001.png", "class-00002.png"]
    assert "generating 3 of 3 class image(s)" in stderr and "class images: 0 reused, 3 generated" in stderr
    assert "holds no export of the base model on any node: PyTorch" in stderr and "(PyTorch)" in stderr
    assert len(set(images.values())) == 3, "each class image has its own seed"
    proc = train(prior_args(tiny_model, dataset, tmp_path / "again", class_dir), cli_env)
    assert "class images: 3 reused, 0 generated" in proc.stderr and "generating" not in proc.stderr
    assert {p.name: p.read_bytes() for p in sorted(class_dir.iterdir())} == images
    # one image gone: only that one is generated again, under its own name, and the others stay as they were
    (class_dir / "class-00001.png").unlink()
    proc = train(prior_args(tiny_model, dataset, tmp_path / "third", class_dir), cli_env)
    assert "class images: 2 reused, 1 generated" in proc.stderr
    for name in ("class-00000.png", "class-00002.png"):
        assert (class_dir / name).read_bytes() == images[name]
    with Image.open(class_dir / "class-00001.png") as im:
        assert im.size == (64, 64)
    assert sorted(p.name for p in class_dir.iterdir()) == list(images), "a temporary file was left behind"


def test_the_summary_records_the_prior_settings(generated):
    class_dir, _, _, summary = generated
    assert summary["prior"] == {
        "class_prompt": "a photo of toy",
        "class_data_dir": str(class_dir),
        "num_class_images": 3,
        "prior_loss_weight": 0.5,
    }


def test_the_memory_estimate_counts_the_class_examples_in_each_step(tiny_model):
    """Each step runs instance + class examples through the UNet: the activations of batch 2 with prior
    preservation are those of batch 4 without; the caches hold the class images' latents and the class prompt."""
    from xeonsd.trainer.argv import parse_config
    from xeonsd.trainer.memory import estimate

    def est(*extra: str, batch: int):
        args = method_args("lora", tiny_model, Path("d"), Path("o"), "--instance_prompt=x", *extra, batch=batch)
        return estimate(parse_config(args), "lora", 5, 1)

    flags = ["--with_prior_preservation", CLASS, "--class_data_dir=c", "--num_class_images=7"]
    prior, plain = est(*flags, batch=2), est(batch=2)
    assert prior.activations == est(batch=4).activations > plain.activations
    side = 64 // 8
    assert prior.caches - plain.caches == 2 * 7 * 2 * 4 * side * side * 4 + 77 * 32 * 4  # 7 latents x2, 1 prompt


def test_prior_two_ranks_learn_what_one_rank_with_double_batch_learns(
    generated, tiny_model, dataset, tmp_path, cli_env
):
    """2 ranks x batch 1 under mpirun == 1 rank x batch 2 with prior preservation on (each rank pairs its own
    examples with their class examples). Tolerance as in test_methods: the mean absolute difference of the LoRA
    up-weights (zero before training) below 1e-4 of their mean, the largest below 5 % of the largest."""
    class_dir, _, _, _ = generated
    one, two = tmp_path / "one", tmp_path / "two"
    train(prior_args(tiny_model, dataset, one, class_dir, batch=2), cli_env)
    proc = train(prior_args(tiny_model, dataset, two, class_dir), cli_env, ranks=2)
    assert "backend=gloo" in proc.stderr and "class images: 3 reused" in proc.stderr
    a, b = load_file(str(one / LORA_FILE)), load_file(str(two / LORA_FILE))
    up = [k for k in a if "up" in k]
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in up])
    update = torch.cat([a[k].abs().flatten() for k in up])
    assert update.max() > 0, "nothing learned"
    assert diff.mean() < 1e-4 * update.mean(), (diff.mean(), update.mean())
    assert diff.max() < 0.05 * update.max(), (diff.max(), update.max())


def test_the_class_loss_changes_the_training(generated, tiny_model, dataset, tmp_path, cli_env):
    """The class examples are in the step: the same run without prior preservation learns other weights."""
    class_dir, _, _, _ = generated
    with_prior = tmp_path / "with"
    train(prior_args(tiny_model, dataset, with_prior, class_dir), cli_env)
    without = tmp_path / "without"
    train(method_args("lora", tiny_model, dataset, without, "--instance_prompt=a photo of sks toy", steps=2), cli_env)
    a, b = load_file(str(with_prior / LORA_FILE)), load_file(str(without / LORA_FILE))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) > 1e-6


def test_textual_inversion_refuses_prior_preservation_with_the_reason(tiny_model, dataset, tmp_path, cli_env):
    args = method_args("textual_inversion", tiny_model, dataset, tmp_path / "out", "--with_prior_preservation")
    err = refused(args, cli_env)
    assert "--with_prior_preservation works with --method lora or full" in err
    assert "textual inversion trains only the concept's new token vectors" in err


def test_a_class_data_dir_that_cannot_be_written_is_refused_before_loading(tiny_model, dataset, tmp_path, cli_env):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = tmp_path / "out"
    err = refused(prior_args(tiny_model, dataset, out, blocker / "class"), cli_env)
    assert f"--class_data_dir {blocker / 'class'} cannot be created for the class images" in err
    assert err.count("error") == 1 and not out.exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--with_prior_preservation"], "--with_prior_preservation needs --class_prompt"),
        ([CLASS], "--class_prompt needs --with_prior_preservation"),
        (["--with_prior_preservation", CLASS, "--class_data_dir=c", "--num_class_images=0"], "at least 1, got 0"),
        (["--with_prior_preservation", CLASS, "--class_data_dir=c", "--prior_loss_weight=0"], "must be positive"),
    ],
)
def test_prior_flags_on_their_own(flags, message, tiny_model, dataset, tmp_path, cli_env):
    args = method_args("lora", tiny_model, dataset, tmp_path / "out", "--instance_prompt=a photo of sks toy", *flags)
    assert message in refused(args, cli_env)
