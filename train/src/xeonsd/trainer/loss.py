"""The loss and noise options of every method: min-SNR-γ weighting (Hang et al. 2023, ``--snr_gamma``), the
timesteps' range (``--timestep_range``), offset noise (``--noise_offset``, drawn in :mod:`.data`'s plan) and the
masked loss's weights (``--masks``: :func:`mask_weights`, the masks from :mod:`.masks`).

Pure functions of tensors and the scheduler's ``alphas_cumprod``; the loop calls :func:`denoising_loss`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from xeonsd.trainer.config import ConfigError


def parse_timestep_range(value: str | None, num_train_timesteps: int | None = None) -> tuple[int, int] | None:
    """``"lo,hi"`` → ``(lo, hi)``, timesteps drawn in [lo, hi); None: the whole range. Refuses anything but
    0 <= lo < hi <= num_train_timesteps (the upper bound checked only when it is known)."""
    if value is None or value == "":
        return None
    bound = f"{num_train_timesteps}" if num_train_timesteps is not None else "the scheduler's num_train_timesteps"
    need = f"two integers lo,hi with 0 <= lo < hi <= {bound} (timesteps are drawn in [lo, hi))"
    parts = value.split(",")
    try:
        lo, hi = (int(p.strip()) for p in parts)
    except ValueError:
        raise ConfigError(f"--timestep_range {value!r}: expected {need}") from None
    if not 0 <= lo < hi or (num_train_timesteps is not None and hi > num_train_timesteps):
        raise ConfigError(f"--timestep_range {value!r}: expected {need}")
    return lo, hi


def local_num_train_timesteps(model: str) -> int | None:
    """The num_train_timesteps of a local pipeline directory's scheduler config (None: a Hub id, or no config), so
    that --timestep_range is checked before the model loads."""
    path = Path(model) / "scheduler" / "scheduler_config.json"
    try:
        value = json.loads(path.read_text()).get("num_train_timesteps", 1000)  # DDPMScheduler's default
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def snr(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """SNR(t) = ᾱ_t / (1 - ᾱ_t) of each timestep, in float64."""
    a = alphas_cumprod.to(torch.float64)[timesteps]
    return a / (1.0 - a)


def min_snr_weights(
    alphas_cumprod: torch.Tensor, timesteps: torch.Tensor, gamma: float, prediction_type: str
) -> torch.Tensor:
    """The per-example weights of min-SNR-γ: min(SNR, γ)/SNR for ε-prediction, min(SNR, γ)/(SNR+1) for
    v-prediction (the v loss is (SNR+1) times the ε loss, so both weigh the ε error by min(SNR, γ))."""
    s = snr(alphas_cumprod, timesteps)
    if prediction_type == "epsilon":
        # min(SNR, γ)/SNR written as min(1, γ/SNR): 1, not 0/0, where a zero-terminal-SNR schedule has SNR = 0
        return torch.clamp(gamma / s, max=1.0)
    if prediction_type == "v_prediction":
        return torch.clamp(s, max=gamma) / (s + 1.0)
    raise ConfigError(f"--snr_gamma: unsupported prediction type {prediction_type!r} in the model's scheduler")


def mask_weights(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``--masks``: each example's latent mask ([b, 1, h, w], :mod:`.masks`) as weights of the squared errors
    ``like`` [b, c, h, w]: the mask over its mean per example, so that the mean of the weighted errors is each
    example's error weighted by its mask and normalised by the mask's sum (a small subject does not get a small
    loss). An all-white mask weighs every element 1 exactly."""
    m = mask.to(like.dtype)
    mean = m.mean(dim=tuple(range(1, m.ndim)), keepdim=True)
    return (m / mean.clamp_min(torch.finfo(m.dtype).tiny)).expand_as(like)


def squared_error(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The element-wise squared error in float32, weighted by ``mask`` (:func:`mask_weights`) when given."""
    se = F.mse_loss(pred.float(), target.float(), reduction="none")
    return se if mask is None else se * mask_weights(mask, se)


def denoising_loss(
    pred: torch.Tensor,
    target: torch.Tensor,
    timesteps: torch.Tensor,
    *,
    snr_gamma: float | None = None,
    alphas_cumprod: torch.Tensor | None = None,
    prediction_type: str = "epsilon",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MSE of ``pred`` against ``target`` (mean over every element); with ``snr_gamma``, the batch mean of
    each example's MSE times its min-SNR-γ weight (as diffusers' train scripts compute it). ``mask`` ([b, 1, h,
    w], ``--masks``): each example's errors weighted by it and normalised by its sum."""
    pred, target = pred.float(), target.float()
    if snr_gamma is None:
        if mask is None:
            return F.mse_loss(pred, target, reduction="mean")
        return squared_error(pred, target, mask).mean()
    assert alphas_cumprod is not None, "min-SNR weighting needs the scheduler's alphas_cumprod"
    per_example = squared_error(pred, target, mask).mean(dim=tuple(range(1, pred.ndim)))
    weights = min_snr_weights(alphas_cumprod, timesteps, snr_gamma, prediction_type).to(per_example.dtype)
    return (per_example * weights).mean()
