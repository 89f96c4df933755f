"""Run metrics: one JSON line per logged step, and the loss plot (raw loss, faint, under its EMA).

While the run is going the lines go to ``metrics.partial.jsonl`` (tail it to watch progress); the finished run
renames it to ``metrics.jsonl``, so a crashed run never leaves a file that looks complete.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xeonsd.contracts.run_files import TRAIN_SUMMARY_FILE
from xeonsd.fsutil import atomic_path

PARTIAL = "metrics.partial.jsonl"
FINAL = "metrics.jsonl"
GRID = "validation_grid.png"  # the validation images over the run (xeonsd.trainer.validation.write_image_grid)


class MetricsLog:
    def __init__(self, out_dir: Path, resume_step: int = 0) -> None:
        self.partial = Path(out_dir) / PARTIAL
        self.final = Path(out_dir) / FINAL
        rows = read_metrics(self.partial) if self.partial.exists() else []
        if not rows and self.final.exists() and resume_step > 0:
            rows = read_metrics(self.final)
        # On resume keep what the checkpoint covers; later lines belong to the interrupted attempt.
        self.rows = [r for r in rows if r.get("step", 0) <= resume_step]
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        with open(self.partial, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in self.rows)
        self.final.unlink(missing_ok=True)

    def append(self, row: dict) -> None:
        self.rows.append(row)
        with open(self.partial, "a") as fh:
            fh.write(json.dumps(row) + "\n")
            fh.flush()

    def finish(self) -> Path:
        self.partial.replace(self.final)
        return self.final


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def ema_window(points: int) -> int:
    """The smoothing window for a loss series of ``points`` logged points: a tenth of them, at least 5, at most 50."""
    return max(5, min(50, points // 10))


class RunningEMA:
    """The EMA of :func:`ema`, one value at a time (the trainer's ``--report_to`` curves follow the loss plot's)."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"EMA window must be at least 1, got {window}")
        self.alpha = 2 / (window + 1)
        self.weighted = self.weights = 0.0

    def update(self, value: float) -> float:
        self.weighted = (1 - self.alpha) * self.weighted + self.alpha * value
        self.weights = (1 - self.alpha) * self.weights + self.alpha
        return self.weighted / self.weights


def ema(values: Sequence[float], window: int) -> list[float]:
    """Exponential moving average with ``alpha = 2 / (window + 1)`` (the usual span convention), bias-corrected.

    Point ``i`` is the mean of values ``0..i`` weighted ``(1 - alpha) ** (i - k)``, divided by the sum of those
    weights: the curve starts at the first value without being pulled towards it for the next ``window`` points,
    as the plain recursion seeded with the first value is (TensorBoard smooths the same way).
    """
    running = RunningEMA(window)
    return [running.update(v) for v in values]


@dataclass(frozen=True)
class LossCurve:
    """The loss as logged (one point every ``every`` steps) and its EMA over ``window`` points."""

    steps: list[int]
    raw: list[float]
    smooth: list[float]
    window: int
    every: int

    @property
    def alpha(self) -> float:
        return 2 / (self.window + 1)

    @property
    def label(self) -> str:
        """The legend's words for the smoothed curve, with its window in steps."""
        span = f"{self.window} steps" if self.every == 1 else f"{self.window} points = {self.window * self.every} steps"
        return f"EMA, window {span} (α={self.alpha:.2f})"


def loss_curve(rows: list[dict]) -> LossCurve:
    """The trainer's metrics rows as a raw and a smoothed loss series (window from :func:`ema_window`)."""
    steps = [int(r["step"]) for r in rows]
    raw = [float(r["loss"]) for r in rows]
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False) if b > a]
    window = ema_window(len(raw))
    return LossCurve(steps, raw, ema(raw, window), window, statistics.median_low(gaps) if gaps else 1)


VALIDATION_LABEL = "validation loss (held-out images, fixed timesteps and noise)"


def validation_points(rows: list[dict]) -> list[tuple[int, float]]:
    """(step, val_loss) of the rows that carry a validation loss (``--validation_split`` / ``_data_dir``)."""
    return [(int(r["step"]), float(r["val_loss"])) for r in rows if r.get("val_loss") is not None]


def loss_figure(rows: list[dict], title: str = "textual inversion") -> Any:
    """The loss per step, faint (on textual inversion it is mostly the noise of the sampled timesteps), with its
    EMA drawn over it (the trend), and the validation loss where the rows have one; a matplotlib Figure (Agg),
    closed by the caller."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = loss_curve(rows)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    raw_label = "loss per step" if curve.every == 1 else f"loss, every {curve.every} steps"
    ax.plot(curve.steps, curve.raw, lw=0.8, alpha=0.45, color="tab:blue", label=raw_label)
    ax.plot(curve.steps, curve.smooth, lw=2.0, color="tab:orange", label=curve.label)
    val = validation_points(rows)
    if val:
        steps, values = zip(*val, strict=True)
        ax.plot(steps, values, "o-", lw=1.5, ms=4, color="tab:green", label=VALIDATION_LABEL)
    ax.set_xlabel("step")
    ax.set_ylabel("MSE loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig


def plot_loss(rows: list[dict], path: Path, title: str = "textual inversion") -> Path:
    """:func:`loss_figure` as a PNG at ``path``."""
    import matplotlib.pyplot as plt

    fig = loss_figure(rows, title)
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)
    return Path(path)


def result_bytes(out_dir: Path, result: str) -> int:
    """The size of a run's result (its method's first output): the embedding or adapter file, or for a pipeline
    (``model_index.json``) every component it lists."""
    out_dir = Path(out_dir)
    path = out_dir / result
    if result != "model_index.json":
        return path.stat().st_size
    components = [k for k in json.loads(path.read_text()) if not k.startswith("_")]
    files = [path, *(p for c in components if (out_dir / c).is_dir() for p in (out_dir / c).rglob("*"))]
    return sum(p.stat().st_size for p in files if p.is_file())


def write_summary(out_dir: Path, summary: dict[str, Any]) -> Path:
    """``train_summary.json`` (for export.yml and the report; rank 0 writes it beside the result): the method, its
    trainable parameters, the base model and its fingerprint, the prompts (captions) used, the bytes all-reduced
    per step and the result with its size."""
    path = Path(out_dir) / TRAIN_SUMMARY_FILE
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
    return path


def read_summary(out_dir: Path) -> dict[str, Any] | None:
    path = Path(out_dir) / TRAIN_SUMMARY_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
