"""Training methods. Each says what is trainable, what the step's prompts are, what a checkpoint holds and what
is saved; the loop in :mod:`xeonsd.trainer.loop` does the rest (data, noise, loss, gradient all-reduce, optimizer,
checkpoints, metrics) the same way for all of them.

* ``textual_inversion``: the concept's token vectors (a few thousand numbers);
* ``lora``: low-rank adapters on the UNet's attention projections (and optionally the text encoder's);
* ``full``: every weight of the UNet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xeonsd.trainer.methods.base import Method

if TYPE_CHECKING:
    from xeonsd.trainer.config import TrainConfig


def method_class(name: str) -> type[Method]:
    from xeonsd.trainer.methods.full import FullFineTuning
    from xeonsd.trainer.methods.lora import LoRA
    from xeonsd.trainer.methods.textual_inversion import TextualInversion

    classes: dict[str, type[Method]] = {c.name: c for c in (TextualInversion, LoRA, FullFineTuning)}
    return classes[name]


def for_config(cfg: TrainConfig) -> type[Method]:
    return method_class(cfg.method)


__all__ = ["Method", "for_config", "method_class"]
