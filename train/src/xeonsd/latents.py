"""VAE latents of the training inputs: cached once, or encoded every step (the recipe's way, kept as baseline).

The VAE encoder maps an image to a diagonal Gaussian (mean, std); training samples ``mean + std * eps``. The
inputs never change during a run (each image and its mirror), so encoding them once and sampling the cached
distribution draws from exactly the same distribution as encoding every step, without the encoder's FLOPs.
"""

from __future__ import annotations

import torch

from xeonsd.distributed import all_reduce_sum_


@torch.no_grad()
def encode_distribution(
    vae: torch.nn.Module, pixels: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the VAE's latent distribution for ``pixels`` [n, 3, H, W], returned in float32."""
    dist = vae.encode(pixels.to(dtype)).latent_dist
    return dist.mean.float(), dist.std.float()


@torch.no_grad()
def build_latent_cache(
    vae: torch.nn.Module,
    pixels: torch.Tensor,
    dtype: torch.dtype,
    latent_shape: tuple[int, int, int],
    rank: int,
    world_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode every distinct input once; each rank encodes every ``world_size``-th input and the results are
    summed across ranks, so the cache costs ``ceil(inputs / ranks)`` encodes per rank."""
    packed = torch.zeros((2, pixels.shape[0], *latent_shape), dtype=torch.float32)
    for i in range(rank, pixels.shape[0], world_size):
        m, s = encode_distribution(vae, pixels[i : i + 1], dtype)
        packed[0, i], packed[1, i] = m[0], s[0]
    all_reduce_sum_(packed, world_size)
    return packed[0], packed[1]


def sample_latents(mean: torch.Tensor, std: torch.Tensor, eps: torch.Tensor, scaling_factor: float) -> torch.Tensor:
    """Scaled latents drawn from N(mean, std^2) with the given standard-normal ``eps``."""
    return (mean + std * eps) * scaling_factor
