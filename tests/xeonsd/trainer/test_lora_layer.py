"""The fused LoRA linear computes peft's LoRA: the same output and gradients from the same fp32 adapter weights,
in fp32 exactly (to rounding) and with a bf16 base to bf16's precision; peft's own forward for what it skips."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import inject_adapter_in_model
from peft.tuners.lora.layer import Linear as PeftLinear
from peft.utils import get_peft_model_state_dict

from xeonsd.trainer.methods.adapters import adapter_config
from xeonsd.trainer.methods.lora_layer import FusedLoraLinear


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q = torch.nn.Linear(64, 48)
        self.to_out = torch.nn.Linear(48, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.to_out(torch.nn.functional.gelu(self.to_q(x)))


def _pair(dtype: torch.dtype, **config) -> tuple[torch.nn.Module, torch.nn.Module]:
    """peft's layers and the fused ones on one base model, with the same adapter weights (B random, not zero)."""
    torch.manual_seed(0)
    base = Attention()
    models = []
    for fused in (False, True):
        model = inject_adapter_in_model(
            adapter_config("lora", 4, 8, ["to_q", "to_out"], fused=fused), copy.deepcopy(base)
        )
        for k, v in config.items():
            setattr(model.to_q, k, v)
        models.append(model)
    torch.manual_seed(1)
    for p in models[0].parameters():
        p.data = (p.data if p.requires_grad else p.data.to(dtype)).clone()
        if p.requires_grad and p.abs().sum() == 0:
            p.data.normal_()
    models[1].load_state_dict(models[0].state_dict())
    for p in models[1].parameters():
        p.data = p.data.float() if p.requires_grad else p.data.to(dtype)
    return models[0], models[1]


def _run(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    x = x.clone().requires_grad_(True)
    out = model(x)
    out.float().square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return out, grads, x.grad


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_the_fused_adapter_gives_peft_s_output_and_gradients(dtype, tol):
    ref, fused = _pair(dtype)
    assert type(ref.to_q) is PeftLinear and type(fused.to_q) is FusedLoraLinear
    assert fused.to_q.lora_A["default"].weight.dtype == torch.float32 and fused.to_q.weight.dtype == dtype
    x = torch.randn(3, 10, 64).to(dtype)
    (out_r, grads_r, gx_r), (out_f, grads_f, gx_f) = _run(ref, x), _run(fused, x)
    assert out_f.dtype == out_r.dtype == dtype and out_f.shape == out_r.shape

    def close(a, b):
        scale = b.float().abs().max()
        assert (a.float() - b.float()).abs().max() <= tol * scale, ((a.float() - b.float()).abs().max(), scale)

    close(out_f, out_r)
    close(gx_f, gx_r)
    assert grads_f.keys() == grads_r.keys() and len(grads_r) == 4
    for name in grads_r:
        assert grads_f[name].dtype == torch.float32
        close(grads_f[name], grads_r[name])
    # The same parameters under the same names: the saved adapter files do not change.
    assert get_peft_model_state_dict(fused).keys() == get_peft_model_state_dict(ref).keys()


def test_what_the_fast_path_does_not_cover_goes_through_peft(monkeypatch):
    _, fused = _pair(torch.float32)
    calls = []
    original = PeftLinear.forward
    monkeypatch.setattr(PeftLinear, "forward", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    x = torch.randn(2, 64)
    fused(x)
    assert calls == []  # the plain adapter: fused
    fused.to_q.lora_dropout["default"] = torch.nn.Dropout(0.1)
    fused.eval()
    fused(x)
    assert len(calls) == 1  # dropout: peft's forward
    fused.to_q.lora_dropout["default"] = torch.nn.Identity()
    unmerged = fused(x)
    fused.to_q.merge()
    assert torch.allclose(fused(x), unmerged, atol=1e-5) and len(calls) == 2  # merged: peft's
