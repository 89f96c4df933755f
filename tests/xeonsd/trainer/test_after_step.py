"""The step-end sequence (xeonsd.trainer.after_step): one explicit order, and on a stop the checkpoint first.

Before it, a stop ran the observers in the normal order: the validation loss (longer than a step) before rank 0's
checkpoint, under the stop's deadline, so a stop could end the rank with no checkpoint at the step it stopped at."""

from __future__ import annotations

import pytest

from xeonsd.trainer.after_step import AFTER_STEP, StepEnd, StepEndSequence


class Recorder:
    def __init__(self, name: str, calls: list[str], fail: bool = False) -> None:
        self.name, self.calls, self.fail = name, calls, fail

    def on_step_end(self, end: StepEnd) -> None:
        self.calls.append(self.name)
        if self.fail:
            raise TimeoutError(f"{self.name} used up the stop's deadline")


def _rank0(calls: list[str], slow: str | None = None) -> StepEndSequence:
    return StepEndSequence({name: Recorder(name, calls, fail=name == slow) for name in AFTER_STEP})


def test_after_a_step_the_validation_loss_comes_before_the_metrics_row_that_carries_it() -> None:
    calls: list[str] = []
    _rank0(calls).run(StepEnd(step=10, loss=0.1, seconds=1.0))
    assert calls == list(AFTER_STEP)
    assert calls.index("validation_loss") < calls.index("metrics")


def test_a_stop_writes_the_checkpoint_before_anything_that_can_use_up_its_deadline() -> None:
    calls: list[str] = []
    with pytest.raises(TimeoutError):
        _rank0(calls, slow="validation_loss").run(StepEnd(step=7, loss=0.1, seconds=1.0, stopping=True))
    assert calls[0] == "checkpoint"
    assert "validation_images" not in calls  # minutes on a CPU: never while the job stops


def test_a_rank_without_a_checkpoint_runs_the_rest_in_order() -> None:
    calls: list[str] = []
    seq = StepEndSequence({n: Recorder(n, calls) for n in ("status", "stats", "validation_loss")})
    seq.run(StepEnd(step=3, loss=0.1, seconds=1.0, stopping=True))
    assert calls == ["status", "stats", "validation_loss"]


def test_an_observer_without_a_place_in_the_sequence_is_refused() -> None:
    with pytest.raises(ValueError, match="without a place"):
        StepEndSequence({"status": Recorder("status", []), "ema": Recorder("ema", [])})
