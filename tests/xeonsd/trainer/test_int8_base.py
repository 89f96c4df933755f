"""``--base_precision int8``: the frozen linears as int8 weights per channel and int8 inputs per token give the
linear's output and input gradient to quantization's error (measured 0.8-1.0 % relative; asserted below 2 %), keep
nothing of their input for the backward, and sit under peft's adapters, whose gradients stay those of the
unquantized model to the same error. The run's loss curve against the training dtype's is in test_learning.py."""

from __future__ import annotations

import copy

import pytest
import torch
from cli_runs import method_args, refused
from peft import inject_adapter_in_model

from xeonsd.trainer.methods.adapters import adapter_config
from xeonsd.trainer.methods.int8_base import Int8Linear, quantize_frozen_linears

TOLERANCE = 0.02  # relative (Frobenius) error of an output or gradient against the unquantized layer's


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_layer_gives_the_linear_s_output_and_input_gradient(dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160).to(dtype).requires_grad_(False)
    linear.weight[3] = 0  # an all-zero output channel: its scale must not divide by zero
    quantized = Int8Linear(linear)
    x = (torch.randn(2, 40, 96) * torch.linspace(0.01, 30, 40)[:, None]).to(dtype).requires_grad_(True)  # mixed rows
    grad = torch.randn(2, 40, 160, dtype=dtype)
    outputs, grads = [], []
    for layer in (linear, quantized):
        x.grad = None
        y = layer(x)
        y.backward(grad)
        outputs.append(y)
        grads.append(x.grad.clone())
    assert outputs[1].dtype == dtype and grads[1].dtype == dtype
    assert torch.isfinite(outputs[1]).all() and torch.isfinite(grads[1]).all()
    assert _relative(outputs[1], outputs[0]) < TOLERANCE
    assert _relative(grads[1], grads[0]) < TOLERANCE
    assert torch.equal(outputs[1][..., 3], linear.bias[3].expand(2, 40).to(dtype))
    assert quantized.weight_q.dtype == torch.int8 and not list(quantized.parameters())


def test_the_int8_layer_keeps_nothing_of_its_input_for_the_backward():
    """A frozen bf16 linear saves its input (for the input gradient it needs the weight only, but F.linear keeps
    both); the int8 layer saves its int8 weight and scales, nothing of the size of the input."""
    linear = torch.nn.Linear(64, 64).requires_grad_(False)
    x = torch.randn(512, 64, requires_grad=True)
    saved: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        Int8Linear(linear)(x).sum().backward()
    assert (512, 64) not in saved and saved, saved


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q = torch.nn.Linear(64, 48)
        self.to_out = torch.nn.Linear(48, 64, bias=False)
        self.ff = torch.nn.Linear(64, 64)
        self.gate = torch.nn.Linear(64, 4)  # under MIN_FEATURES: stays as it is

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.to_out(torch.nn.functional.gelu(self.to_q(x)))
        return self.ff(h) * self.gate(h).mean(-1, keepdim=True)


@pytest.mark.parametrize("fused", [True, False])
def test_adapters_train_on_the_int8_layers_as_on_the_linears(fused):
    torch.manual_seed(0)
    model = inject_adapter_in_model(adapter_config("lora", 4, 8, ["to_q", "to_out"], fused=fused), Block())
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
        if "lora_B" in name:
            p.data.normal_()  # B starts at zero: give the adapters something to pass
    reference = copy.deepcopy(model)
    swapped, held = quantize_frozen_linears(model)
    assert swapped == 3 and held == (64 * 48 + 48 * 64 + 64 * 64) * 4
    assert isinstance(model.to_q.base_layer, Int8Linear) and isinstance(model.ff, Int8Linear)
    assert type(model.gate) is torch.nn.Linear
    x = torch.randn(8, 16, 64)
    for m in (reference, model):
        m(x).square().mean().backward()
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    expected = {n: p for n, p in reference.named_parameters() if p.requires_grad}
    assert trained.keys() == expected.keys() and len(trained) == 4
    for name, p in expected.items():
        assert _relative(trained[name].grad, p.grad) < TOLERANCE, name


def test_int8_frozen_layers_take_plain_lora_only(tiny_model, dataset, tmp_path, cli_env):
    data = dataset
    args = method_args("lora", tiny_model, data, tmp_path / "out", "--adapter=dora", "--base_precision=int8")
    err = refused([*args, "--instance_prompt=a photo of toy"], cli_env)
    assert "--base_precision int8 takes --adapter lora, not dora" in err
    err = refused(method_args("full", tiny_model, data, tmp_path / "out", "--base_precision=int8"), cli_env)
    assert "--base_precision" in err
