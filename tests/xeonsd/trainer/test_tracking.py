"""``--report_to``: a run's curves and validation images in TensorBoard's event files, read back with TensorBoard's
own reader; the names a metrics row's values get; the EMA matching the loss plot's; and a backend whose package is
missing refused before anything loads."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_runs import refused, run_cli, train_args

from xeonsd.trainer.metrics import ema
from xeonsd.trainer.tracking import Tracker, scalars


def test_a_row_s_values_get_their_curve_s_names_and_the_ema_is_the_plot_s() -> None:
    row = {
        "step": 4,
        "loss": 0.5,
        "lr": 1e-4,
        "s_per_step": 2.0,
        "images_per_s": 8.0,
        "allreduce_bytes": 1024,
        "val_loss": None,
        "rank_stats": {"nodes": [{"node": "node1", "cpu_util": 0.9}, {"node": "node2", "cpu_util": 0.4}]},
    }
    assert scalars(row, 0.6) == {
        "train/loss": 0.5,
        "train/lr": 1e-4,
        "train/s_per_step": 2.0,
        "train/images_per_s": 8.0,
        "train/allreduce_bytes": 1024.0,
        "train/loss_ema": 0.6,
        "cpu_util/node1": 0.9,
        "cpu_util/node2": 0.4,
    }
    assert scalars({"step": 1, "loss": 1.0, "val_loss": 0.7})["val/loss"] == 0.7
    # the logged EMA is the loss plot's, and a resumed run's goes on from the rows its checkpoint kept
    losses = [1.0, 0.5, 0.8, 0.2, 0.4, 0.1]
    logged: list[dict[str, float]] = []
    backend = SimpleNamespace(log=lambda step, values: logged.append(dict(values)), image=None, close=None)
    tracker = Tracker(backend, 5, earlier_losses=losses[:3])
    for step, loss in enumerate(losses[3:], 4):
        tracker.log_row({"step": step, "loss": loss})
    assert [v["train/loss_ema"] for v in logged] == pytest.approx(ema(losses, 5)[3:])


def test_tensorboard_holds_the_run_s_scalars_and_validation_images(tiny_model, dataset, tmp_path, cli_env) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    extra = ["--report_to=tensorboard", "--validation_prompt=a photo of a <dicoo>", "--num_validation_images=1"]
    proc = run_cli(["train", *train_args(tiny_model, dataset, out, *extra, "--validation_steps=2", steps=3)], cli_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    tags = events.Tags()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [r["step"] for r in rows] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    for name in ("train/loss_ema", "train/lr", "train/s_per_step", "train/images_per_s", "train/allreduce_bytes"):
        assert [e.step for e in events.Scalars(name)] == [1, 2, 3], name
    assert any(t.startswith("cpu_util/") for t in tags["scalars"]), tags["scalars"]
    # the step-2 render and the final one, each image under its file's name
    assert sorted(tags["images"]) == ["validation/00", "validation_final/00"], tags["images"]
    image = events.Images("validation/00")[0]
    assert (image.step, image.width, image.height) == (2, 64, 64)


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is not None, reason="the refusal needs an env without mlflow")
def test_a_backend_this_env_lacks_and_a_tracking_uri_without_mlflow_are_refused(
    tiny_model, dataset, tmp_path: Path, cli_env
) -> None:
    err = refused(train_args(tiny_model, dataset, tmp_path / "o", "--report_to=mlflow"), cli_env)
    assert "--report_to mlflow needs the mlflow package, which this environment lacks: pip install mlflow" in err
    err = refused(train_args(tiny_model, dataset, tmp_path / "o", "--tracking_uri=http://mlflow:5000"), cli_env)
    assert "--tracking_uri is MLflow's; --report_to is none: add --report_to mlflow" in err
    assert not (tmp_path / "o" / "tensorboard").exists()
