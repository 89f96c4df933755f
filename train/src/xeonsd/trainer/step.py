"""The training step's parts, each taking its inputs explicitly: the denoising loss of some examples, the
gradient all-reduce and the update. The loop (:mod:`.loop`) runs them for the training examples, the validation
loss (:mod:`.validation`) runs :func:`step_loss` for the held-out ones; neither hands the other a job to fake."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from xeonsd.cluster.distributed import all_reduce_mean_
from xeonsd.cluster.rank_stats import RankClock
from xeonsd.trainer.data import Example
from xeonsd.trainer.methods import Method
from xeonsd.trainer.models import Models
from xeonsd.trainer.prior import PriorData, model_inputs


@dataclass(frozen=True)
class LossInputs:
    """What the denoising loss of a batch reads: the models (scheduler, dtypes), the UNet to call (the training
    one, DistributedDataParallel-wrapped or not), the text conditioning and the latents the examples index, the
    class side of prior preservation, and the loss flags."""

    models: Models
    unet: torch.nn.Module
    text: Any  # a PromptConditioning (xeonsd.trainer.conditioning) of the family
    latents: Any  # a LatentTable (xeonsd.trainer.latents)
    prior: PriorData | None = None
    snr_gamma: float | None = None
    channels_last: bool = False


def step_loss(inputs: LossInputs, examples: list[Example], clock: RankClock | None = None) -> torch.Tensor:
    """The denoising loss of these examples (mean over them; the family's objective: :meth:`TrainFamily.predict`
    and ``loss``); ``clock`` times the latent lookup as data. With prior preservation each example is paired with
    a class example in the same denoiser call (:mod:`.prior`): the loss is the instance mean plus
    ``--prior_loss_weight`` times the class mean. With ``--masks`` the instance examples' loss is masked
    (:mod:`.masks`)."""
    models = inputs.models
    with clock.phase("data") if clock else contextlib.nullcontext():
        batch = model_inputs(inputs.text, inputs.latents, examples)
        if inputs.prior is not None:  # the class examples join this rank's examples in the one UNet call
            batch = inputs.prior.join(batch, examples)
        latents, noise, timesteps, hidden, added = batch
    family = models.training
    pred, target = family.predict(models, inputs.unet, latents, noise, timesteps, hidden, added, inputs.channels_last)

    # --masks: the instance examples' latent masks (None: unmasked; the class examples and a held-out table's
    # examples have none, so the prior's loss and the validation loss stay unmasked)
    mask = inputs.latents.mask_of(examples)

    def loss(rows: slice, mask: torch.Tensor | None = None) -> torch.Tensor:
        return family.loss(models, pred[rows], target[rows], timesteps[rows], inputs.snr_gamma, mask)

    if inputs.prior is None:
        return loss(slice(None), mask)
    n = len(examples)
    return loss(slice(0, n), mask) + inputs.prior.weight * loss(slice(n, None))


def sync_gradients(params: list[torch.nn.Parameter], loss_sum: float, world: int, ddp: bool) -> float:
    """Average the gradients of ``params`` (unless DistributedDataParallel already did) and the loss over the
    ranks, in one all-reduce; returns the mean loss."""
    if ddp:
        packed = torch.tensor([loss_sum])
        all_reduce_mean_(packed, world)
        return float(packed[0])
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if world == 1:  # nothing to average; packing would briefly hold every gradient twice (+3.4 GB for a full UNet)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        return loss_sum
    packed = torch.cat([*(g.reshape(-1).float() for g in grads), torch.tensor([loss_sum])])
    all_reduce_mean_(packed, world)
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = packed[offset : offset + n].view_as(g).to(g.dtype)
        offset += n
    return float(packed[-1])


def update(method: Method, optimizer: torch.optim.Optimizer, lr_scheduler: Any, done: int) -> None:
    """The optimizer step (the gradients clipped first when the method asks), the schedule's, and the method's
    own after-step work (e.g. an EMA update) for step ``done``."""
    if method.max_grad_norm:
        torch.nn.utils.clip_grad_norm_(method.parameters(), method.max_grad_norm)
    optimizer.step()
    lr_scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    method.after_step(done)
