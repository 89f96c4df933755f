"""The interface between the training loop and a method."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from xeonsd.trainer.argv import flag_methods
from xeonsd.trainer.config import ConfigError
from xeonsd.trainer.prompt_tables import PromptTable, plain_prompts

if TYPE_CHECKING:
    from xeonsd.trainer.captions import Captions
    from xeonsd.trainer.config import TrainConfig
    from xeonsd.trainer.models import Models


class Method:
    """One way of fine-tuning. The loop calls, in order: ``check`` (before any model loads), the constructor
    (models loaded; makes the trainable parameters), ``prompts``, then per step ``after_step``; ``state`` /
    ``load_state`` for checkpoints, and ``save`` on rank 0 at the end."""

    name: ClassVar[str]
    #: files whose presence means the output dir holds a finished run of this method
    outputs: ClassVar[tuple[str, ...]]
    #: the UNet's weights: trained in fp32 under bf16 autocast (full), or frozen in the training dtype
    unet_fp32: ClassVar[bool] = False
    #: the trainable numbers are the UNet's or adapters on it (fp32 tensors of their own, their gradient flows
    #: through the UNet's weights); False: they sit in the text encoders' embedding tables (textual inversion)
    trains_unet: ClassVar[bool] = True
    #: what the run trains on without captions (the refusal of caption-only flags names it)
    prompt_source: ClassVar[str] = "--instance_prompt"
    #: the trained weights are sharded over the ranks (--fsdp): every rank runs each denoiser call, and ``state``,
    #: ``optimizer_state`` and ``save`` are collective (every rank calls them, rank 0 writes)
    sharded: bool = False

    def __init__(self, cfg: TrainConfig, models: Models) -> None:
        self.cfg = cfg
        self.models = models

    # ---- before the models load --------------------------------------------------------------------------------
    @classmethod
    def check(cls, cfg: TrainConfig, captions: Captions | None) -> None:
        """Refuse flag values or captions this method cannot use (ConfigError / DataError)."""

    @classmethod
    def uses_captions(cls, cfg: TrainConfig, captions: Captions | None) -> bool:
        """Whether the run trains on the captions (``--captions`` auto|on|off)."""
        if cfg.captions == "off":
            return False
        if cfg.captions == "on" and captions is None:
            raise ConfigError(
                f"--captions on, but {cfg.train_data_dir} has no captions (metadata.jsonl, a .txt file beside each "
                "image, or captions.txt)"
            )
        return captions is not None

    @classmethod
    def check_captions(cls, cfg: TrainConfig, captions: Captions, where: str) -> None:
        """Refuse captions this method cannot train on (the training images' and the held-out ones, alike)."""

    # ---- the memory estimate (xeonsd.trainer.memory, on meta-device models) ----------------------------------------
    @classmethod
    def memory_trainable(
        cls, cfg: TrainConfig, unet: torch.nn.Module, encoders: list[tuple[object, object]], family=None
    ) -> int:
        """The trainable numbers, from the meta denoiser (which the method may change: LoRA's adapters), the text
        encoders' (config, meta model) pairs (a flow family's CLIP ones) and the family."""
        raise NotImplementedError

    @classmethod
    def memory_optimizer_bytes(cls, cfg: TrainConfig, trainable: int) -> int:
        """The optimizer's state: AdamW's two fp32 moments."""
        return trainable * 8

    # ---- set-up ------------------------------------------------------------------------------------------------
    @classmethod
    def text_first(cls, cfg: TrainConfig) -> PlainText | None:
        """The prompts' side (``prompts``, ``trains_text_encoder``) before the method exists, when it does not
        depend on the method: then the prompts are encoded before the denoiser loads
        (:func:`xeonsd.trainer.models.loads_in_phases`). None: they need the method's instance."""
        return None

    @property
    def trains_text_encoder(self) -> bool:
        """False: the text encoder is frozen, so the prompts' embeddings are computed once before the first step."""
        return False

    @property
    def max_grad_norm(self) -> float:
        """Clip the all-reduced gradient's norm to this (0: no clipping)."""
        return self.cfg.max_grad_norm if self.name in flag_methods("max_grad_norm") else 0.0

    def parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer trains (fp32)."""
        raise NotImplementedError

    def ddp_module(self) -> torch.nn.Module | None:
        """A module whose gradients DistributedDataParallel all-reduces in buckets during the backward pass; None:
        the loop packs ``parameters()``' gradients into one all-reduce after it (small gradients)."""
        return None

    def prompts(self, captions: Captions | None) -> PromptTable:
        """The prompt table the steps condition on: the captions, or ``--instance_prompt``."""
        return plain_prompts(self.cfg, self.uses_captions(self.cfg, captions), captions)

    # ---- the steps ---------------------------------------------------------------------------------------------
    def after_step(self, step: int) -> None:
        """After each optimizer step (e.g. an EMA update)."""

    def periodic_save(self, out: Path, step: int) -> None:
        """Rank 0, after each step: method-specific snapshots (textual inversion's --save_steps)."""

    # ---- checkpoint and outputs --------------------------------------------------------------------------------
    def state(self) -> dict:
        raise NotImplementedError

    def load_state(self, state: dict, where: str) -> None:
        raise NotImplementedError

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)

    def save(self, out: Path) -> None:
        """Rank 0 (every rank when ``sharded``; rank 0 writes): write the run's result into ``out`` (each file
        atomically)."""
        raise NotImplementedError

    def label(self) -> str:
        """What the run trains, in a title (the loss plot's)."""
        return self.name

    def summary(self) -> dict:
        """Figures for metrics and the report (trainable parameters, …)."""
        return {"method": self.name, "trainable_params": sum(p.numel() for p in self.parameters())}


@dataclass(frozen=True)
class PlainText:
    """The prompts of a method that trains the denoiser only: the captions or ``--instance_prompt``, through frozen
    text encoders (:meth:`Method.text_first`)."""

    method: type[Method]
    cfg: TrainConfig
    trains_text_encoder: bool = False

    def prompts(self, captions: Captions | None) -> PromptTable:
        return plain_prompts(self.cfg, self.method.uses_captions(self.cfg, captions), captions)
