"""The step-end sequence: what runs after each optimizer step, in one explicit order, and the order after the step
the ranks agreed to stop at.

After a normal step: this rank's status file, the ranks' statistics (an all-gather), the validation loss (every
rank its share, before the metrics row that carries it), rank 0's progress, metrics row and checkpoint, then the
validation images. After the stop's step the checkpoint comes first: the stop has a deadline
(:class:`xeonsd.trainer.stopping.StopDeadline`) and whatever runs before the checkpoint (a validation loss takes
longer than a step) could use it up, so that the job would stop with no checkpoint at the step it stopped at. The
validation images (minutes on a CPU) do not run on a stop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class StepEnd:
    """A finished optimizer step, as the observers see it."""

    step: int  # the steps done (1 after the first)
    loss: float  # averaged over the ranks
    seconds: float  # this rank's wall time for the step
    stopping: bool = False  # the ranks agreed to stop after this step (a signal)


class StepObserver(Protocol):
    def on_step_end(self, end: StepEnd) -> None: ...


# Every observer by name, in the order it runs after a normal step.
AFTER_STEP = ("status", "stats", "validation_loss", "progress", "metrics", "checkpoint", "validation_images")
# After the step the ranks agreed to stop at: the checkpoint first; the validation images not at all.
AFTER_STOP = ("checkpoint", "status", "stats", "validation_loss", "progress", "metrics")


class StepEndSequence:
    """The observers a rank has (rank 0 has more than the others), run in :data:`AFTER_STEP` or, on a stop, in
    :data:`AFTER_STOP` order. Every name must be one of :data:`AFTER_STEP`'s."""

    def __init__(self, observers: Mapping[str, StepObserver]) -> None:
        unknown = set(observers) - set(AFTER_STEP)
        if unknown:
            raise ValueError(f"step-end observers without a place in the sequence: {sorted(unknown)}")
        self.observers = dict(observers)

    def order(self, stopping: bool) -> list[str]:
        """The names that run, in order, after a step (``stopping``: the stop's step)."""
        return [name for name in (AFTER_STOP if stopping else AFTER_STEP) if name in self.observers]

    def run(self, end: StepEnd) -> None:
        for name in self.order(end.stopping):
            self.observers[name].on_step_end(end)
