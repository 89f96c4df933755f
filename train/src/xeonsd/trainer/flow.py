"""The rectified-flow objective of the transformer families (FLUX.1, SD3/SD3.5), as they were trained and as
diffusers' ``train_dreambooth_lora_flux.py`` / ``train_dreambooth_lora_sd3.py`` train them:

* an example's noisy input is x_σ = (1 − σ)·x₀ + σ·ε, and the model predicts the velocity ε − x₀;
* σ is drawn per example: u from ``--weighting_scheme``'s density (diffusers'
  ``compute_density_for_timestep_sampling``: ``logit_normal`` with ``--logit_mean``/``--logit_std``, ``mode`` with
  ``--mode_scale``, else uniform), then σ = the model's own ``FlowMatchEulerDiscreteScheduler`` training grid at
  index ⌊u·N⌋ (N = ``num_train_timesteps``): its static ``shift``, or, with ``use_dynamic_shifting`` (FLUX.1), the
  resolution-dependent shift its pipeline applies at that image's token count (mu from ``base_shift`` …
  ``max_shift`` over ``base_image_seq_len`` … ``max_image_seq_len``);
* each example's squared error is weighted by ``compute_loss_weighting_for_sd3`` (``sigma_sqrt``: σ⁻², ``cosmap``:
  2 / (π(1 − 2σ + 2σ²)), else 1), and the loss is the batch mean of the per-example means.

Pure functions of tensors and the scheduler config; u is drawn by the sampling plan (:mod:`.data`) from the
example's own stream, so σ is a function of (seed, global index) like every other draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from xeonsd.trainer.config import ConfigError
from xeonsd.trainer.loss import squared_error

# --weighting_scheme: the σ densities and the loss weights, as diffusers' scripts name them ("uniform" = "none").
DENSITIES = ("logit_normal", "mode")
LOSS_WEIGHTS = ("sigma_sqrt", "cosmap")
WEIGHTING_SCHEMES = (*DENSITIES, "uniform", *LOSS_WEIGHTS, "none")


def resolve_scheme(scheme: str | None, default: str) -> str:
    """The run's weighting scheme: the flag's, or the family's diffusers default (``FamilySpec.weighting_scheme``:
    train_dreambooth_lora_flux.py's none, _sd3.py's logit_normal)."""
    scheme = scheme or default
    if scheme not in WEIGHTING_SCHEMES:
        raise ConfigError(f"--weighting_scheme {scheme!r}: choose one of {', '.join(WEIGHTING_SCHEMES)}")
    return scheme


@dataclass(frozen=True)
class FlowSchedule:
    """How σ is drawn and weighted: the weighting scheme with its parameters, and the model's scheduler config."""

    scheme: str
    logit_mean: float
    logit_std: float
    mode_scale: float
    num_train_timesteps: int
    shift: float
    dynamic: bool  # use_dynamic_shifting: the shift follows the image's token count (FLUX.1)
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_seq_len: int = 256
    max_seq_len: int = 4096
    patch: int = 2  # latent pixels per token side (FLUX's 2x2 packing, SD3's 2x2 patches)
    guidance: float = 3.5  # FLUX.1-dev's guidance input (--guidance_scale)

    @classmethod
    def from_config(
        cls,
        scheduler_config,
        scheme: str,
        logit_mean: float,
        logit_std: float,
        mode_scale: float,
        guidance: float = 3.5,
    ):
        c = dict(scheduler_config)
        return cls(
            guidance=guidance,
            scheme=scheme,
            logit_mean=logit_mean,
            logit_std=logit_std,
            mode_scale=mode_scale,
            num_train_timesteps=int(c.get("num_train_timesteps", 1000)),
            shift=float(c.get("shift", 1.0)),
            dynamic=bool(c.get("use_dynamic_shifting", False)),
            base_shift=float(c.get("base_shift") or 0.5),
            max_shift=float(c.get("max_shift") or 1.15),
            base_seq_len=int(c.get("base_image_seq_len") or 256),
            max_seq_len=int(c.get("max_image_seq_len") or 4096),
        )

    def draw_u(self, g: torch.Generator) -> float:
        """One u in [0, 1) from the scheme's density (diffusers' compute_density_for_timestep_sampling)."""
        from diffusers.training_utils import compute_density_for_timestep_sampling

        u = compute_density_for_timestep_sampling(
            self.scheme, 1, self.logit_mean, self.logit_std, self.mode_scale, generator=g
        )
        return float(u[0])

    def mu(self, latent_shape: tuple[int, ...]) -> float:
        """FLUX.1's shift exponent at this latent's token count (its pipeline's ``calculate_shift``)."""
        tokens = (latent_shape[-2] // self.patch) * (latent_shape[-1] // self.patch)
        m = (self.max_shift - self.base_shift) / (self.max_seq_len - self.base_seq_len)
        return tokens * m + self.base_shift - m * self.base_seq_len

    def sigma(self, u: float, latent_shape: tuple[int, ...]) -> float:
        """σ of the scheduler's training grid at index ⌊u·N⌋: grid point i is (N − i)/N, shifted."""
        n = self.num_train_timesteps
        index = min(max(int(u * n), 0), n - 1)
        s = (n - index) / n
        if self.dynamic:
            return math.exp(self.mu(latent_shape)) / (math.exp(self.mu(latent_shape)) + (1 / s - 1))
        return self.shift * s / (1 + (self.shift - 1) * s)

    def weights(self, sigmas: torch.Tensor) -> torch.Tensor:
        """Each example's loss weight (diffusers' compute_loss_weighting_for_sd3)."""
        from diffusers.training_utils import compute_loss_weighting_for_sd3

        return compute_loss_weighting_for_sd3(self.scheme, sigmas.to(torch.float64)).float()


def noisy_input(latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """x_σ = (1 − σ)·x₀ + σ·ε, σ per example."""
    s = sigmas.reshape(-1, *([1] * (latents.ndim - 1))).to(latents.dtype)
    return (1.0 - s) * latents + s * noise


def flow_loss(
    pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The batch mean of each example's weighted mean squared error (as diffusers' scripts reduce it); ``mask``
    ([b, 1, h, w], ``--masks``): each example's errors weighted by it and normalised by its sum."""
    per_example = squared_error(pred, target, mask).reshape(pred.shape[0], -1).mean(dim=1)
    return (per_example * weights.to(per_example.dtype)).mean()
