"""Which kernel computes the denoiser's attention in a training step, and the same choice in the memory estimate.

torch's CPU flash-attention kernel keeps only the output and the log-sum-exp for the backward, but on a Zen 4
EPYC it runs at 23-24 % of the bf16 matmul peak where the matmuls run at 79 % (docs/benchmarks.md). For
self-attention over mid-length sequences (SD 1.5 and SDXL at 32x32 latents, 1024 tokens) two matmuls around a
softmax were faster there in a micro-benchmark, and their score matrix is small (tens of MB); for long sequences
(4096 tokens at 64x64), short ones and cross-attention the flash kernel was faster. ``--attention mixed`` takes
the matmuls where :func:`matmul_applies` says so and the flash kernel everywhere else; ``flash`` (the default)
takes the flash kernel everywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from xeonsd.trainer.config import ATTENTION_KERNELS

# Self-attention of at least this many tokens, with a score matrix (batch x heads x tokens x tokens) of at most
# this many bytes, takes the matmuls under --attention mixed.
MATMUL_MIN_TOKENS = 512
MATMUL_MAX_SCORE_BYTES = 32 * 2**20
_SDPA_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale")  # after query, key, value


def _qkv(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """query, key, value and the other arguments of an SDPA call, positional or by name (diffusers' attention
    dispatch passes them by name)."""
    kwargs = dict(kwargs)
    named = [kwargs.pop(n, None) for n in ("query", "key", "value")]
    q, k, v = (*args[:3], *named[len(args[:3]) :])[:3]
    for name, value in zip(_SDPA_ARGS, args[3:], strict=False):
        kwargs[name] = value
    if kwargs.get("enable_gqa") is False:
        kwargs.pop("enable_gqa")
    return q, k, v, kwargs


def matmul_applies(q: torch.Tensor, k: torch.Tensor, rest: dict) -> bool:
    """Whether this SDPA call is a plain self-attention of the size the matmuls are faster for."""
    if rest.get("attn_mask") is not None or rest.get("dropout_p") or rest.get("is_causal"):
        return False
    if set(rest) - set(_SDPA_ARGS) or q.dim() != 4:
        return False
    tokens = q.shape[-2]
    scores = q.shape[0] * q.shape[1] * tokens * k.shape[-2] * q.element_size()
    return k.shape[-2] == tokens >= MATMUL_MIN_TOKENS and scores <= MATMUL_MAX_SCORE_BYTES


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale) v as two matmuls in the inputs' dtype (the softmax accumulates in fp32)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    return torch.matmul(torch.softmax(scores, dim=-1), v)


class MixedAttention(TorchFunctionMode):
    """Routes each ``F.scaled_dot_product_attention`` call made inside it: the matmuls where
    :func:`matmul_applies`, the call unchanged everywhere else (autograd records whichever ran)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v, rest = _qkv(args, kwargs)
            if matmul_applies(q, k, rest):
                return matmul_attention(q, k, v, rest.get("scale"))
        return func(*args, **kwargs)


def attention_kernels(choice: str) -> contextlib.AbstractContextManager:
    """The context a denoiser's forward runs in for ``--attention choice``."""
    if choice not in ATTENTION_KERNELS:
        raise ValueError(f"unknown attention kernel {choice!r}; choose one of {', '.join(ATTENTION_KERNELS)}")
    return MixedAttention() if choice == "mixed" else contextlib.nullcontext()


@contextlib.contextmanager
def meta_attention(choice: str = "flash") -> Iterator[None]:
    """For the memory estimate's meta forward: on meta tensors SDPA takes the math path, which keeps the whole
    score matrix for the backward (GBs at 512 px); CPU tensors take the flash kernel, which keeps only the output
    and the log-sum-exp. Route each meta call to what a real step under ``--attention choice`` runs, so the saved
    tensors are the ones that step keeps."""
    from unittest import mock

    plain = F.scaled_dot_product_attention

    def routed(*args, **kwargs):
        q, k, v, rest = _qkv(args, kwargs)
        if choice == "mixed" and matmul_applies(q, k, rest):
            return matmul_attention(q, k, v, rest.get("scale"))
        if rest.get("attn_mask") is not None or rest.get("dropout_p") or set(rest) - set(_SDPA_ARGS):
            return plain(q, k, v, **rest)
        causal, scale = rest.get("is_causal", False), rest.get("scale")
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[0]

    with mock.patch.object(F, "scaled_dot_product_attention", routed):
        yield
