"""The validation loss: which images are held out, the refusals, the fixed timesteps and noise, and tiny runs
whose metrics rows carry it; the loss plot and the report show it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cli_runs import method_args, refused, train

from xeonsd.trainer.argv import parse_config
from xeonsd.trainer.captions import read_captions
from xeonsd.trainer.config import ConfigError
from xeonsd.trainer.data import DataError, find_images
from xeonsd.trainer.validation import HeldOut, ValidationSet, check_held_out, fixed_timesteps, hold_out


def _cfg(*extra: str, data: Path = Path("d"), method: str = "lora"):
    return parse_config(method_args(method, Path("m"), data, Path("o"), *extra))


@pytest.fixture(scope="module")
def captioned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from xeonsd.assets import make_dataset

    out = tmp_path_factory.mktemp("val") / "captioned"
    make_dataset(out, count=5, size=64, captions="txt")
    return out


def test_the_split_is_chosen_by_file_name_and_keeps_each_caption_with_its_image(captioned: Path) -> None:
    images = find_images(captioned)
    captions = read_captions(captioned, images)
    train_images, train_caps, held = hold_out(_cfg("--validation_split=0.4", data=captioned), images, captions)
    assert held is not None and held.source == "--validation_split 0.4"
    assert len(held.images) == 2 and len(train_images) == 3  # round(0.4 x 5)
    assert sorted(train_images + held.images) == images and not set(train_images) & set(held.images)
    by_image = dict(zip(images, captions.texts, strict=True))
    assert list(train_caps.texts) == [by_image[p] for p in train_images]
    assert list(held.captions.texts) == [by_image[p] for p in held.images]
    # the same images whatever the seed (the choice does not draw from it); a small split still holds one out
    again = hold_out(_cfg("--validation_split=0.4", "--seed=99", data=captioned), images, captions)[2]
    assert again.images == held.images
    assert len(hold_out(_cfg("--validation_split=0.01", data=captioned), images, captions)[2].images) == 1
    assert hold_out(_cfg(data=captioned), images, captions) == (images, captions, None)


def test_bad_validation_flags_are_refused(captioned: Path, tmp_path: Path) -> None:
    images = find_images(captioned)
    with pytest.raises(
        ConfigError,
        match=r"--validation_split 0.95 holds out 5 of the 5 image\(s\) of .* which leaves no training image",
    ):
        hold_out(_cfg("--validation_split=0.95", data=captioned), images, None)
    with pytest.raises(ConfigError, match=r"--validation_split is a fraction in \(0, 1\)"):
        hold_out(_cfg("--validation_split=1.5", data=captioned), images, None)
    with pytest.raises(ConfigError, match="give one"):
        hold_out(_cfg("--validation_split=0.2", f"--validation_data_dir={captioned}"), images, None)
    with pytest.raises(DataError, match="--validation_data_dir .*nowhere does not exist"):
        hold_out(_cfg(f"--validation_data_dir={tmp_path / 'nowhere'}"), images, None)
    # held-out images without captions, in a run that trains on captions
    bare = HeldOut(images[:1], None, f"--validation_data_dir {tmp_path}")
    with pytest.raises(DataError, match="its images have no captions, but this run trains on captions"):
        check_held_out(_cfg(), bare, uses_captions=True)
    check_held_out(_cfg(), bare, uses_captions=False)  # an instance prompt needs none
    with pytest.raises(ConfigError, match="--validation_steps must be at least 1"):
        check_held_out(_cfg("--validation_steps=0"), bare, uses_captions=False)


def test_the_timesteps_and_noise_are_fixed() -> None:
    assert fixed_timesteps(0, 1000) == (125, 375, 625, 875)
    assert fixed_timesteps(100, 900) == (200, 400, 600, 800)
    assert fixed_timesteps(0, 1000, 2) == (250, 750)
    held = HeldOut([Path("a.png"), Path("b.png")], None, "x")
    vs = ValidationSet(
        held,
        SimpleNamespace(num_templates=3),
        text=None,
        latents=SimpleNamespace(shape=(4, 8, 8)),
        timesteps=(125, 375, 625, 875),
        seed=7,
    )
    assert vs.size == 8
    e = vs.example(5)  # image 1 (never mirrored), its second timestep, template 1 of 3
    assert (e.input_id, e.timestep, e.template) == (2, 375, 1)
    f = vs.example(5)
    assert torch.equal(e.noise, f.noise) and torch.equal(e.latent_eps, f.latent_eps)
    assert not torch.equal(vs.example(4).noise, e.noise)


def test_validation_runs_log_the_held_out_loss_and_do_not_change_training(tiny_model, captioned, tmp_path, cli_env):
    """1 rank x batch 2 evaluated every 2 steps, and 2 ranks x batch 1 (each rank its share of the validation
    examples) evaluated every step: the same training loss and the same validation loss at steps 2 and 4. The
    inputs are fixed, the ranks' shares add up, and the evaluations change nothing in the training (their own
    draws, no gradient)."""
    runs = {}
    for every, ranks, batch in ((2, 1, 2), (1, 2, 1)):
        out = tmp_path / f"every-{every}"
        args = method_args(
            "lora",
            tiny_model,
            captioned,
            out,
            "--validation_split=0.2",
            f"--validation_steps={every}",
            "--learning_rate=5e-2",
            steps=4,
            batch=batch,
        )
        proc = train(args, cli_env, ranks=ranks)
        assert "validation loss at step 2:" in proc.stderr
        runs[every] = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        summary = json.loads((out / "train_summary.json").read_text())
        assert summary["validation"]["source"] == "--validation_split 0.2"
        assert len(summary["validation"]["images"]) == 1 and summary["validation"]["timesteps"] == [125, 375, 625, 875]
    assert [r["step"] for r in runs[2] if "val_loss" in r] == [2, 4]
    assert [r["step"] for r in runs[1] if "val_loss" in r] == [1, 2, 3, 4]
    val2 = {r["step"]: r["val_loss"] for r in runs[2] if "val_loss" in r}
    val1 = {r["step"]: r["val_loss"] for r in runs[1] if "val_loss" in r}
    assert val1[2] == pytest.approx(val2[2], rel=1e-4) and val1[4] == pytest.approx(val2[4], rel=1e-4)
    assert [r["loss"] for r in runs[1]] == pytest.approx([r["loss"] for r in runs[2]], rel=1e-4)
    assert val1[1] != pytest.approx(val1[4], rel=1e-3)  # the adapter learns: the held-out loss moves


def test_a_split_that_leaves_nothing_to_train_on_exits_2(tiny_model, dataset, tmp_path, cli_env) -> None:
    data = tmp_path / "two"
    data.mkdir()
    for p in sorted(dataset.glob("*.png"))[:2]:
        shutil.copy(p, data / p.name)
    err = refused(method_args("textual_inversion", tiny_model, data, tmp_path / "o", "--validation_split=0.8"), cli_env)
    assert "--validation_split 0.8 holds out 2 of the 2 image(s)" in err and "leaves no training image" in err


def test_the_plot_and_the_report_show_the_validation_loss(demo_metrics, tmp_path) -> None:
    import matplotlib.pyplot as plt

    from xeonsd.ops.report import training_summary
    from xeonsd.trainer.metrics import VALIDATION_LABEL, loss_figure

    rows = [dict(r) for r in demo_metrics]
    for r, v in zip((rows[9], rows[19], rows[29]), (0.9, 0.7, 0.8), strict=True):
        r["val_loss"] = v
    fig = loss_figure(rows)
    try:
        (green,) = [ln for ln in fig.axes[0].lines if ln.get_label() == VALIDATION_LABEL]
        assert list(green.get_xdata()) == [10, 20, 30] and list(green.get_ydata()) == [0.9, 0.7, 0.8]
    finally:
        plt.close(fig)
    assert training_summary(rows)[VALIDATION_LABEL] == "0.9000 at step 10 → 0.8000 at step 30; lowest 0.7000 at step 20"
    assert VALIDATION_LABEL not in training_summary(demo_metrics)


def test_the_report_shows_the_validation_images_grid(tmp_path) -> None:
    from PIL import Image

    from xeonsd.ops.report import build_report
    from xeonsd.trainer.validation import write_image_grid

    assert write_image_grid(tmp_path) is None  # no validation images: no grid
    for sub, colour in (("step-10", "red"), ("step-2", "blue"), ("final", "green")):
        (tmp_path / "validation" / sub).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (64, 64), colour).save(tmp_path / "validation" / sub / f"{i:02d}.png")
    grid = Image.open(write_image_grid(tmp_path, cell=32)).convert("RGB")
    assert grid.size == (3 * 32, 16 + 3 * 32)
    # columns in step order (2 before 10), then the final images
    assert [grid.getpixel((c * 32 + 16, 16 + 2 * 32 + 16)) for c in range(3)] == [(0, 0, 255), (255, 0, 0), (0, 128, 0)]
    page = build_report(tmp_path)
    assert "<h2>Validation images</h2>" in page and 'src="validation_grid.png"' in page
