"""The loss plot's smoothing: an EMA whose window the legend states, checked on a recorded run."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from xeonsd.trainer.metrics import ema, ema_window, loss_curve, loss_figure, plot_loss


def test_ema_is_the_bias_corrected_exponential_average() -> None:
    # window 3: alpha 1/2. Point i is sum(alpha (1-alpha)^(i-k) x_k) / (1 - (1-alpha)^(i+1)).
    assert ema([1.0, 2.0, 3.0], 3) == pytest.approx([1.0, 5 / 3, 17 / 7], abs=1e-12)
    assert ema([2.5] * 7, 5) == pytest.approx([2.5] * 7, abs=1e-12)  # a constant series stays put
    assert ema([], 5) == []
    with pytest.raises(ValueError, match="at least 1"):
        ema([1.0], 0)


@pytest.mark.parametrize(("points", "window"), [(1, 5), (30, 5), (59, 5), (100, 10), (200, 20), (499, 49), (5000, 50)])
def test_ema_window_is_a_tenth_of_the_points_between_5_and_50(points: int, window: int) -> None:
    assert ema_window(points) == window


def test_smoothed_demo_run_has_the_stated_window_and_values(demo_metrics: list[dict]) -> None:
    curve = loss_curve(demo_metrics)
    assert (curve.window, curve.every, curve.alpha) == (5, 1, pytest.approx(1 / 3))
    assert curve.label == "EMA, window 5 steps (α=0.33)"
    assert curve.raw == [r["loss"] for r in demo_metrics] and curve.steps == list(range(1, 31))
    expected = {0: 1.0813, 1: 1.067020, 4: 1.121110, 9: 1.125507, 19: 1.163907, 25: 1.191350, 29: 1.134147}
    assert {i: round(curve.smooth[i], 6) for i in expected} == expected
    # What the smoothing is for: the curve moves a third as much from step to step as the raw loss does.
    moves = [statistics.mean(abs(b - a) for a, b in zip(v, v[1:], strict=False)) for v in (curve.raw, curve.smooth)]
    assert moves[1] < moves[0] / 2.5


def test_logged_every_n_steps_the_window_is_stated_in_points_and_steps() -> None:
    rows = [{"step": s, "loss": 1.0} for s in [*range(10, 201, 10), 205]]  # the last row: the run's final step
    curve = loss_curve(rows)
    assert curve.every == 10 and curve.label == "EMA, window 5 points = 50 steps (α=0.33)"


def test_plot_draws_the_raw_loss_faint_and_its_ema_over_it(demo_metrics: list[dict], tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = loss_figure(demo_metrics, title="<dicoo>")
    try:
        raw, smooth = fig.axes[0].get_lines()
        assert list(raw.get_ydata()) == [r["loss"] for r in demo_metrics]
        assert list(smooth.get_ydata()) == loss_curve(demo_metrics).smooth
        assert raw.get_alpha() < 0.5 and smooth.get_linewidth() > raw.get_linewidth()
        legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert legend == ["loss per step", "EMA, window 5 steps (α=0.33)"]
    finally:
        plt.close(fig)
    assert plot_loss(demo_metrics, tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
