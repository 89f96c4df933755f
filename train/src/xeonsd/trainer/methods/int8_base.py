"""Frozen linear layers in int8 (``--base_precision int8``, LoRA): the multiplies the adapters do not own, on the
CPU's int8 units (AMX-INT8 has twice AMX-BF16's multiply rate).

In a LoRA step the frozen linears carry most of the matmuls, in the forward and in the input gradient; their
weights never change, so :func:`quantize_frozen_linears` quantizes them once per run:

* the weight per output channel, symmetric: ``W ~ s_w[n] * Wq[n, k]`` (``Wq`` int8 in [-127, 127]);
* the forward quantizes each token of the input on the fly (``x ~ s_x[m] * xq[m, k]``) and multiplies
  ``xq Wq^T`` in int32 (``torch._int_mm``: oneDNN, AMX-INT8 or VNNI), then scales by ``s_x[m] s_w[n]``;
* the backward needs only the input's gradient (the weight is frozen): ``dL/dx = (g s_w) W_q``, the output gradient
  scaled per channel by ``s_w`` and quantized per token, again one int8 matmul. Nothing of the input is kept for
  the backward: the layer saves less than a bf16 one.

The adapters (peft's ``lora.Linear`` around the layer, :mod:`.lora_layer`) stay in the compute dtype: only
``base_layer`` is swapped. Convolutions, norms and embeddings keep the training dtype. The quantization error is
about 1 % of each output (per-token, per-channel scales); test_learning.py compares a run's losses and learned
adapters with the training dtype's, and ``xeonsd bench train --method lora --extra`` its step ("int8 base").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QMAX = 127.0
# Below this many inputs or outputs a layer's matmul is too small for int8 to pay for its quantization passes
# (time embeddings, norms' modulation heads of tiny test models keep the training dtype as well).
MIN_FEATURES = 16


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (rows x k, bf16 or fp32) as int8 rows and their fp32 scales (rows x 1): ``x ~ scale * q``. The passes
    stay in ``x``'s dtype (bf16 holds the integers to 127 with half a unit of rounding, as fine as its input): in
    fp32 they cost 5x the int8 matmul they feed."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp_min_(1e-30).div_(QMAX)
    q = (x * (1.0 / scale).to(x.dtype)).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


class _Int8Matmul(torch.autograd.Function):
    """``y = x W^T (+ b)`` with ``W`` as int8 rows and their scales; the gradient flows to ``x`` only."""

    @staticmethod
    def forward(ctx, x, weight_q, weight_scale, bias):  # noqa: ANN001 - autograd's signature
        flat = x.reshape(-1, x.shape[-1])
        xq, x_scale = _quantize_rows(flat)
        y = torch._int_mm(xq, weight_q.t()).float().mul_(x_scale).mul_(weight_scale)
        if bias is not None:
            y.add_(bias)
        ctx.save_for_backward(weight_q, weight_scale)
        ctx.in_shape, ctx.dtype = x.shape, x.dtype
        return y.to(x.dtype).view(*x.shape[:-1], weight_q.shape[0])

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        weight_q, weight_scale = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])
        gq, g_scale = _quantize_rows(flat * weight_scale.to(flat.dtype))
        dx = torch._int_mm(gq, weight_q).float().mul_(g_scale)
        return dx.to(ctx.dtype).view(ctx.in_shape), None, None, None


class Int8Linear(torch.nn.Module):
    """A frozen ``nn.Linear`` held as int8 weights with per-output-channel scales (module docstring)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            q, scale = _quantize_rows(linear.weight.detach().float())  # once per run: in fp32
        self.register_buffer("weight_q", q)
        self.register_buffer("weight_scale", scale.view(-1))  # fp32, one per output channel
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.bfloat16, torch.float32):  # never in training; keep the layer usable anyway
            return F.linear(x, self.dequantized().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return _Int8Matmul.apply(x, self.weight_q, self.weight_scale, self.bias)

    def dequantized(self) -> torch.Tensor:
        """The weight the int8 layer multiplies by, in fp32 (for tests and for a fallback)."""
        return self.weight_q.float() * self.weight_scale[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def _swappable(module: torch.nn.Module) -> bool:
    return (
        type(module) is torch.nn.Linear
        and not module.weight.requires_grad
        and min(module.in_features, module.out_features) >= MIN_FEATURES
    )


def quantize_frozen_linears(model: torch.nn.Module) -> tuple[int, int]:
    """Swap every frozen ``nn.Linear`` of ``model`` (peft's ``base_layer`` under an adapter included) for an
    :class:`Int8Linear`, in place. Returns (layers swapped, bytes of weights they held before)."""
    swapped, held = 0, 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _swappable(child):
                held += child.weight.numel() * child.weight.element_size()
                setattr(parent, name, Int8Linear(child))
                swapped += 1
    return swapped, held
