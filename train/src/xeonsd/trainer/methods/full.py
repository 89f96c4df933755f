"""Full fine-tuning of the UNet (text encoder and VAE frozen).

fp32 master weights with bf16 autocast on AMX, AdamW, optional gradient checkpointing and an EMA of the weights.
The gradients (one per UNet weight, ~3.4 GB for SD 1.5) are all-reduced by DistributedDataParallel in buckets
that overlap the backward pass. With ``--fsdp`` on 2+ ranks the UNet is sharded instead (:mod:`..sharding`): each
rank holds 1/world of the weights, gradients, AdamW moments and EMA, and the checkpoints and the result are
gathered to rank 0 in the plain layout. The result is a complete pipeline in the output dir, which
``xeonsd export`` takes as it is.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from xeonsd.cluster.distributed import collective
from xeonsd.contracts.method_names import result_file
from xeonsd.families import family_spec
from xeonsd.trainer import sharding
from xeonsd.trainer.checkpoint import CheckpointError
from xeonsd.trainer.config import ConfigError
from xeonsd.trainer.methods.base import Method, PlainText
from xeonsd.trainer.pipelines import save_full_pipeline
from xeonsd.trainer.prompt_tables import check_prompt_source

log = logging.getLogger("xeonsd.train")

if TYPE_CHECKING:
    from xeonsd.trainer.captions import Captions


class EMA:
    """Exponential moving average of parameters, with the usual warm-up: decay = min(decay, (1+n)/(10+n))."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float) -> None:
        self.decay = decay
        self.updates = 0
        self.shadow = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self, params: list[torch.nn.Parameter]) -> None:
        self.updates += 1
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for s, p in zip(self.shadow, params, strict=True):
            s.lerp_(p.detach(), 1.0 - d)

    def state(self) -> dict:
        """The whole averaged weights (collective when they are sharded: every rank calls it)."""
        return {"decay": self.decay, "updates": self.updates, "shadow": [sharding.whole(s) for s in self.shadow]}

    def load(self, state: dict) -> None:
        self.updates = int(state["updates"])
        for s, saved in zip(self.shadow, state["shadow"], strict=True):
            s.copy_(sharding.local_copy(saved, s))


class FullFineTuning(Method):
    name = "full"
    outputs = (result_file("full"),)
    unet_fp32 = True

    @classmethod
    def check(cls, cfg, captions: Captions | None) -> None:
        if cfg.use_ema and not 0.0 < cfg.ema_decay < 1.0:
            raise ConfigError(f"--ema_decay must be between 0 and 1, got {cfg.ema_decay}")
        for flag in ("channels_last", "compile"):  # FSDP2 (torch 2.13) shards contiguous weights of plain modules only
            if cfg.fsdp and getattr(cfg, flag):
                raise ConfigError(f"--fsdp cannot shard a UNet with --{flag}: leave out one of the two")
        check_prompt_source(cls.name, cfg, cls.uses_captions(cfg, captions))

    @classmethod
    def memory_trainable(cls, cfg, unet, encoders, family=None) -> int:
        """The whole UNet (measured without gradient checkpointing: the block figures give its effect)."""
        unet.requires_grad_(True)
        return sum(p.numel() for p in unet.parameters())

    @classmethod
    def memory_optimizer_bytes(cls, cfg, trainable: int) -> int:
        """AdamW's moments, and with --use_ema the EMA copy of the UNet (fp32)."""
        return trainable * 8 + (trainable * 4 if cfg.use_ema else 0)

    def __init__(self, cfg, models) -> None:
        super().__init__(cfg, models)
        unet = models.unet
        unet.requires_grad_(True)
        unet.train()
        if cfg.gradient_checkpointing:
            unet.enable_gradient_checkpointing()
        self.denoiser_class, self.denoiser_config = type(unet), unet.config  # the saved pipeline's plain denoiser
        self.sharded = sharding.shards(cfg)
        if self.sharded:  # before the optimizer and the EMA see the parameters: theirs are the shards
            sharding.shard(unet)
            with collective("barrier before the whole denoiser's shared file is let go"):
                torch.distributed.barrier()  # (a rank still loading it would build it again)
            models.unshare("unet")
        elif cfg.fsdp:
            log.info("--fsdp on one rank: nothing to shard, the UNet trains whole")
        self.params = [p for p in unet.parameters() if p.requires_grad]
        self.ema = EMA(self.params, cfg.ema_decay) if cfg.use_ema else None

    @classmethod
    def text_first(cls, cfg) -> PlainText:
        return PlainText(cls, cfg)

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.params

    def ddp_module(self) -> torch.nn.Module | None:
        return None if self.sharded else self.models.unet

    def after_step(self, step: int) -> None:
        if self.ema is not None:
            self.ema.update(self.params)

    def state(self) -> dict:
        return {
            "unet": sharding.full_weights(self.models.unet),
            "ema": self.ema.state() if self.ema is not None else None,
        }

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """By parameter name, whole: a checkpoint resumes on any number of ranks, with or without --fsdp."""
        return sharding.full_optimizer_state(self.models.unet, optimizer)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        sharding.load_full_optimizer_state(self.models.unet, optimizer, state)

    def load_state(self, state: dict, where: str) -> None:
        if (state.get("ema") is None) != (self.ema is None):
            raise CheckpointError(
                f"checkpoint {where} was trained {'with' if state.get('ema') is not None else 'without'} --use_ema; "
                "resume it with the same setting"
            )
        sharding.load_full_weights(self.models.unet, state["unet"])
        if self.ema is not None:
            self.ema.load(state["ema"])

    def save(self, out: Path) -> None:
        unet = self.models.unet
        if self.ema is not None:  # the run is over: the averaged weights become the saved UNet
            with torch.no_grad():
                for p, s in zip(self.params, self.ema.shadow, strict=True):
                    p.copy_(s)
        unet.eval()
        if self.sharded:  # every rank sends its shards; rank 0 saves them as a plain denoiser
            weights = sharding.full_weights(unet)
            if torch.distributed.get_rank() != 0:
                return
            with torch.device("meta"):
                unet = self.denoiser_class.from_config(self.denoiser_config)
            unet.load_state_dict(weights, assign=True)
            unet.eval()
        save_full_pipeline(self.cfg, out, self.models.family, **{family_spec(self.models.family).denoiser: unet})
