"""The optimizer and its learning-rate schedule, over the method's trainable parameters."""

from __future__ import annotations

import torch

from xeonsd.trainer.config import TrainConfig
from xeonsd.trainer.methods import Method


def make_optimizer(cfg: TrainConfig, method: Method, world: int) -> tuple[torch.optim.Optimizer, object]:
    """AdamW over the method's parameters (``--scale_lr`` scales the rate by the global batch), and its schedule."""
    lr = cfg.learning_rate
    if cfg.scale_lr:
        lr = lr * cfg.gradient_accumulation_steps * cfg.train_batch_size * world
    optimizer = torch.optim.AdamW(
        method.parameters(),
        lr=lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        weight_decay=cfg.adam_weight_decay,
        eps=cfg.adam_epsilon,
        # fused: one kernel per tensor instead of ~10 elementwise ops; None: torch's default for CPU tensors (the loop)
        fused=cfg.fused_adamw or None,
    )
    from diffusers.optimization import get_scheduler

    lr_scheduler = get_scheduler(
        cfg.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=cfg.lr_warmup_steps,
        num_training_steps=cfg.max_train_steps,
    )
    return optimizer, lr_scheduler
