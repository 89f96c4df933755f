"""--random_flip: each method flips as its diffusers recipe does (textual inversion half the examples, LoRA and full
fine-tuning none), the flag turns it either way from the command line and the playbooks, a run that does not flip
samples and encodes no mirror, and the disk latent cache serves runs of both kinds."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from xeonsd.trainer.argv import parse_config
from xeonsd.trainer.data import SamplingPlan
from xeonsd.trainer.data import flips as run_flips

REPO = Path(__file__).resolve().parents[3]
BASE = ["--pretrained_model_name_or_path=model", "--train_data_dir=data"]


def flips(*argv: str) -> bool:
    return run_flips(parse_config([*BASE, *argv]))


def test_each_method_flips_as_its_recipe_and_the_flag_turns_it_either_way():
    assert flips("--method=textual_inversion", "--placeholder_token=<t>", "--initializer_token=toy")
    assert not flips("--method=lora") and not flips("--method=full")
    assert flips("--method=lora", "--random_flip") and flips("--method=full", "--random_flip")
    assert not flips("--method=textual_inversion", "--placeholder_token=<t>", "--no-random_flip")


def test_the_playbook_variable_gives_the_flag_either_way_or_leaves_it_to_the_method():
    spec = importlib.util.spec_from_file_location("xeonsd_train", REPO / "plugins" / "filter" / "xeonsd_train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("xeonsd_train", module)
    spec.loader.exec_module(module)
    argv = {value: module.train_argv({"finetune_random_flip": value}, "lora") for value in ("", True, False, "no")}
    assert argv[""] == ["--method=lora"]
    assert argv[True] == ["--method=lora", "--random_flip"]
    assert argv[False] == argv["no"] == ["--method=lora", "--no-random_flip"]


def test_a_plan_that_does_not_flip_draws_everything_else_as_one_that_does():
    """flip_p 0 changes the input row of the mirrored examples only: the plan stays a function of (seed, index)."""
    kw = {"seed": 3, "num_images": 5, "num_templates": 4, "num_timesteps": 1000, "latent_shape": (4, 8, 8)}
    flipping, plain = SamplingPlan(**kw), SamplingPlan(**kw, flip_p=0.0)
    a, b = [flipping.example(k) for k in range(40)], [plain.example(k) for k in range(40)]
    assert {e.input_id % 2 for e in a} == {0, 1} and {e.input_id % 2 for e in b} == {0}
    assert [e.input_id // 2 for e in a] == [e.input_id // 2 for e in b]
    assert [(e.template, e.timestep) for e in a] == [(e.template, e.timestep) for e in b]
    assert all(
        torch.equal(x.noise, y.noise) and torch.equal(x.latent_eps, y.latent_eps) for x, y in zip(a, b, strict=True)
    )


@pytest.fixture(scope="module")
def sd_models(tiny_model):
    from diffusers import AutoencoderKL

    from xeonsd.families.registry import by_name

    vae = AutoencoderKL.from_pretrained(tiny_model, subfolder="vae")
    return SimpleNamespace(training=by_name("sd").training, vae=vae, weight_dtype=torch.float32)


def test_a_run_that_does_not_flip_encodes_no_mirror_and_the_disk_cache_serves_both_kinds(
    tiny_model, dataset, sd_models, tmp_path
):
    """A LoRA run encodes each image once (its cache files hold one row); a run that flips finds no mirror there,
    encodes both rows and rewrites the files; a run that does not flip then reuses them and encodes nothing. The
    image rows are the same in all three."""
    from xeonsd.trainer.data import find_images
    from xeonsd.trainer.latents import LatentTable, cached_rows

    images = find_images(dataset)
    cfg = parse_config(
        [f"--pretrained_model_name_or_path={tiny_model}", f"--train_data_dir={dataset}", "--method=lora"]
        + ["--resolution=64", f"--latent_cache_dir={tmp_path / 'cache'}"]
    )
    plain = LatentTable.build(cfg, sd_models, images, 0, 0, 1)
    files = sorted((tmp_path / "cache").glob("*.safetensors"))
    assert (plain.encoded, plain.inputs, plain.count) == (len(images), len(images), 2 * len(images))
    assert len(files) == len(images) and {cached_rows(f) for f in files} == {1}
    assert plain.mean[1::2].abs().sum() == 0 and plain.mean[0::2].abs().sum() > 0

    flipping = LatentTable.build(dataclasses.replace(cfg, random_flip=True), sd_models, images, 0, 0, 1)
    assert (flipping.encoded, flipping.inputs) == (2 * len(images), 2 * len(images))
    assert {cached_rows(f) for f in files} == {2}
    torch.testing.assert_close(flipping.mean[0::2], plain.mean[0::2])
    assert (flipping.mean[1::2] - flipping.mean[0::2]).abs().max() > 1e-3  # the mirrors are images of their own

    again = LatentTable.build(cfg, sd_models, images, 0, 0, 1)
    assert again.encoded == 0
    torch.testing.assert_close(again.mean[0::2], plain.mean[0::2])


def test_the_validation_set_encodes_no_mirror(tiny_model, dataset, sd_models):
    """Without a disk cache too: the rows a run never samples are not encoded (``mirrors=False``)."""
    from xeonsd.trainer.data import find_images
    from xeonsd.trainer.latents import LatentTable

    images = find_images(dataset)
    cfg = parse_config(
        [f"--pretrained_model_name_or_path={tiny_model}", f"--train_data_dir={dataset}", "--method=textual_inversion"]
        + ["--placeholder_token=<t>", "--initializer_token=toy", "--resolution=64"]
    )
    assert run_flips(cfg)
    table = LatentTable.build(cfg, sd_models, images, 0, 0, 1, mirrors=False)
    assert (table.encoded, table.inputs) == (len(images), len(images))
    assert table.mean[1::2].abs().sum() == 0
