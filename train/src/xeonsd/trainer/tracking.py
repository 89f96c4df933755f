"""Training curves where ML engineers look: ``--report_to tensorboard|mlflow`` (diffusers' flag name; ``none``, the
default, adds nothing to the stack).

Rank 0 hands the tracker each row it writes to ``metrics.jsonl`` (:class:`~xeonsd.trainer.after_step.observers.MetricsRows`) and
the validation images it renders. :func:`scalars` names a row's values the same way for both backends:
``train/loss``, ``train/loss_ema`` (bias-corrected, the smoothing of the loss plot: :class:`~.metrics.RunningEMA`),
``train/lr``, ``train/s_per_step``, ``train/images_per_s``, ``train/allreduce_bytes``, ``val/loss`` where the run
has held-out images, and ``cpu_util/<node>``: each node's mean CPU use over its ranks, from the gathered rank
statistics (``--stats_every``).

* ``tensorboard``: event files in ``OUTPUT_DIR/tensorboard`` (``tensorboard --logdir runs/`` shows every run). A
  resumed run drops the events past its checkpoint, as ``metrics.jsonl`` drops the lines past it.
* ``mlflow``: a run named after the output directory in ``--tracking_uri`` (else ``MLFLOW_TRACKING_URI``, else
  ``./mlruns``), with the flags as parameters and the images as artifacts.

Either package is checked before any model loads (:func:`check_report_to`), and imported only when chosen.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from xeonsd.contracts.run_files import TENSORBOARD_DIR
from xeonsd.trainer.config import ConfigError, TrainConfig
from xeonsd.trainer.metrics import RunningEMA, ema_window

# A metrics row's value → its name on the curves.
ROW_SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "s_per_step": "train/s_per_step",
    "images_per_s": "train/images_per_s",
    "allreduce_bytes": "train/allreduce_bytes",
    "val_loss": "val/loss",
}
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow"}


def check_report_to(cfg: TrainConfig) -> None:
    """Refuse a ``--report_to`` whose package this environment lacks, before anything loads."""
    package = PACKAGES.get(cfg.report_to)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"--report_to {cfg.report_to} needs the {package} package, which this environment lacks: "
            f"pip install {package}, or --report_to none (metrics.jsonl and loss.png are written either way)"
        )
    if cfg.tracking_uri and cfg.report_to != "mlflow":
        raise ConfigError(f"--tracking_uri is MLflow's; --report_to is {cfg.report_to}: add --report_to mlflow")


def scalars(row: Mapping[str, Any], loss_ema: float | None = None) -> dict[str, float]:
    """A metrics row's values by their curve's name (see the module's docstring)."""
    out = {name: float(row[key]) for key, name in ROW_SCALARS.items() if row.get(key) is not None}
    if loss_ema is not None:
        out["train/loss_ema"] = float(loss_ema)
    for node in (row.get("rank_stats") or {}).get("nodes", []):
        out[f"cpu_util/{node['node']}"] = float(node["cpu_util"])
    return out


class Backend(Protocol):
    def log(self, step: int, values: Mapping[str, float]) -> None: ...
    def image(self, step: int, tag: str, pixels: Any) -> None: ...
    def close(self) -> None: ...


class TensorBoard:
    def __init__(self, out_dir: Path, resume_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run's events past its checkpoint belong to the interrupted attempt
        self.writer = SummaryWriter(str(out_dir / TENSORBOARD_DIR), purge_step=resume_step + 1 if resume_step else None)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def image(self, step: int, tag: str, pixels: Any) -> None:
        self.writer.add_image(tag, pixels, step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MLflow:
    def __init__(self, cfg: TrainConfig, out_dir: Path) -> None:
        import mlflow

        self.mlflow = mlflow
        if cfg.tracking_uri:
            mlflow.set_tracking_uri(cfg.tracking_uri)
        mlflow.start_run(run_name=out_dir.name)
        flags = {k: v for k, v in dataclasses.asdict(cfg).items() if v is not None and not isinstance(v, list | dict)}
        mlflow.log_params({k: str(v)[:500] for k, v in flags.items()})

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.mlflow.log_metrics(dict(values), step=step)

    def image(self, step: int, tag: str, pixels: Any) -> None:
        self.mlflow.log_image(pixels, key=tag, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class Tracker:
    """Rank 0's curves: the metrics rows and the validation images, to the chosen backend."""

    def __init__(self, backend: Backend, window: int, earlier_losses: Iterable[float] = ()) -> None:
        self.backend = backend
        self.ema = RunningEMA(window)
        for loss in earlier_losses:  # a resumed run's EMA goes on from the rows its checkpoint covers
            self.ema.update(loss)

    def log_row(self, row: Mapping[str, Any]) -> None:
        smooth = self.ema.update(float(row["loss"])) if row.get("loss") is not None else None
        self.backend.log(int(row["step"]), scalars(row, smooth))

    def log_images(self, step: int, folder: Path, tag: str = "validation") -> None:
        """The PNGs of ``folder`` (a validation render), one image each under ``tag/<file stem>``."""
        import numpy as np
        from PIL import Image

        for path in sorted(Path(folder).glob("*.png")):
            with Image.open(path) as im:
                self.backend.image(step, f"{tag}/{path.stem}", np.asarray(im.convert("RGB")))

    def close(self) -> None:
        self.backend.close()


def open_tracker(cfg: TrainConfig, resume_step: int, earlier_rows: Iterable[Mapping[str, Any]] = ()) -> Tracker | None:
    """Rank 0's tracker for ``--report_to`` (None for ``none``); ``earlier_rows``: the metrics rows a resumed run
    keeps."""
    if cfg.report_to == "none":
        return None
    out = cfg.output_path
    backend: Backend = TensorBoard(out, resume_step) if cfg.report_to == "tensorboard" else MLflow(cfg, out)
    window = ema_window(max(1, cfg.max_train_steps // max(1, cfg.log_every)))
    return Tracker(backend, window, [float(r["loss"]) for r in earlier_rows if r.get("loss") is not None])
