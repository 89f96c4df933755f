"""The LoRA linear layer the trainer adapts a frozen model with: peft's, with a forward that stays in the compute
dtype.

peft's ``lora.Linear`` casts every adapter's input to the adapter's dtype, so with a bf16 base and fp32 adapters
(fp32 master weights, as the trainer keeps them) each adapted projection makes, forward and backward, full-size
fp32 copies of its input and output: the cast in, the up-projection's output, its scaling, the promoted sum and the
cast back. :class:`FusedLoraLinear` computes the adapter as autocast would, in the input's dtype from the fp32
weights (cast once per call, ``rank x features``: nothing), and folds the scaling into the up weight and the sum
into the up-projection's matmul (``addmm``): ``base(x) + (x A^T)(s B)^T``, one pass over the output. The
parameters, their names, the optimizer's fp32 update and the saved files are peft's, unchanged. Anything the fast
path does not cover (several or disabled adapters, merged weights, dropout, DoRA and other variants, extra
arguments) goes through peft's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear


class FusedLoraLinear(Linear):
    """peft's LoRA ``Linear`` with the single-adapter forward in the compute dtype (module docstring)."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        adapter = self._fast_adapter(args, kwargs)
        if adapter is None:
            return super().forward(x, *args, **kwargs)
        result = self.base_layer(x)
        down = F.linear(x, self.lora_A[adapter].weight.to(x.dtype))
        up = (self.lora_B[adapter].weight * self.scaling[adapter]).to(x.dtype)
        flat = torch.addmm(result.reshape(-1, result.shape[-1]), down.reshape(-1, down.shape[-1]), up.t())
        return flat.view(result.shape)

    def _fast_adapter(self, args: tuple, kwargs: dict) -> str | None:
        """The one plain adapter the fast path computes, or None where peft's forward must run."""
        if args or kwargs or self.disable_adapters or self.merged or len(self.active_adapters) != 1:
            return None
        adapter = self.active_adapters[0]
        if adapter not in self.lora_A or adapter in self.lora_variant or self.lora_bias.get(adapter, False):
            return None
        if not isinstance(self.lora_dropout[adapter], torch.nn.Identity):
            return None
        return adapter
