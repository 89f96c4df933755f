"""--attention mixed: mid-size self-attention as two matmuls computes what the flash kernel computes, the rule
picks the calls it says, and the memory estimate's meta forward takes the same choice as the step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cli_runs import method_args, train
from safetensors.torch import load_file

from xeonsd.trainer.attention import (
    MATMUL_MIN_TOKENS,
    attention_kernels,
    matmul_applies,
    matmul_attention,
    meta_attention,
)


def _qkv(tokens: int, keys: int | None = None, heads: int = 2, dim: int = 16, device: str = "cpu"):
    torch.manual_seed(0)
    q = torch.randn(1, heads, tokens, dim, device=device, requires_grad=device == "cpu")
    k = torch.randn(1, heads, keys or tokens, dim, device=device, requires_grad=device == "cpu")
    v = torch.randn(1, heads, keys or tokens, dim, device=device, requires_grad=device == "cpu")
    return q, k, v


def test_the_matmuls_compute_the_flash_kernel_s_attention_and_gradients():
    q, k, v = _qkv(600)
    out = matmul_attention(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v)
    assert torch.allclose(out, ref, atol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.allclose(g, r, atol=1e-4)
    assert torch.allclose(matmul_attention(q, k, v, scale=0.3), F.scaled_dot_product_attention(q, k, v, scale=0.3),
                          atol=1e-5)  # fmt: skip


def test_only_plain_mid_size_self_attention_takes_the_matmuls():
    q, k, _ = _qkv(1024, device="meta")
    assert matmul_applies(q, k, {})
    assert matmul_applies(q, k, {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None})
    assert not matmul_applies(*_qkv(MATMUL_MIN_TOKENS - 1, device="meta")[:2], {})  # short: flash
    assert not matmul_applies(*_qkv(1024, keys=77, device="meta")[:2], {})  # cross-attention: flash
    assert not matmul_applies(*_qkv(4096, heads=8, device="meta")[:2], {})  # a 256 MiB score matrix: flash
    mask = torch.ones(1024, 1024, dtype=torch.bool, device="meta")
    for rest in ({"attn_mask": mask}, {"dropout_p": 0.1}, {"is_causal": True}, {"enable_gqa": True}):
        assert not matmul_applies(q, k, rest), rest


def test_under_mixed_the_step_s_attention_calls_are_routed_by_the_rule():
    long_, short = _qkv(1024), _qkv(64)
    with attention_kernels("mixed"):
        routed = F.scaled_dot_product_attention(*long_)
        by_name = F.scaled_dot_product_attention(query=long_[0], key=long_[1], value=long_[2], enable_gqa=False)
        kept = F.scaled_dot_product_attention(*short)
    assert "Flash" not in type(routed.grad_fn).__name__ and "Flash" not in type(by_name.grad_fn).__name__
    assert "Flash" in type(kept.grad_fn).__name__
    assert torch.allclose(routed, matmul_attention(*long_)) and torch.allclose(by_name, routed)
    with attention_kernels("flash"):
        assert "Flash" in type(F.scaled_dot_product_attention(*long_).grad_fn).__name__
    with pytest.raises(ValueError, match="unknown attention kernel 'fast'; choose one of flash, mixed"):
        attention_kernels("fast")


def test_the_estimate_s_meta_forward_saves_what_the_chosen_kernel_saves():
    def saved_bytes(choice: str) -> int:
        sizes = []

        def pack(t):
            sizes.append(t.numel() * t.element_size())
            return t

        q, k, v = (t.requires_grad_(True) for t in _qkv(1024, device="meta"))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), meta_attention(choice):
            F.scaled_dot_product_attention(q, k, v)
        return sum(sizes)

    scores = 2 * 1024 * 1024 * 4  # heads x tokens x tokens, fp32: the softmax the second matmul keeps
    assert saved_bytes("flash") < scores / 4 < scores <= saved_bytes("mixed")


def test_a_mixed_run_learns_what_a_flash_run_learns(tiny_model, dataset, tmp_path, cli_env):
    """At 192 px the tiny UNet's first blocks attend over 576 tokens, so the mixed run takes the matmuls there."""
    flash, mixed = tmp_path / "flash", tmp_path / "mixed"
    common = ("--mixed_precision=no", "--resolution=192", "--instance_prompt=a photo of toy")
    train([*method_args("lora", tiny_model, dataset, flash, *common, steps=2), "--attention=flash"], cli_env)
    train([*method_args("lora", tiny_model, dataset, mixed, *common, steps=2), "--attention=mixed"], cli_env)
    a = load_file(str(flash / "pytorch_lora_weights.safetensors"))
    b = load_file(str(mixed / "pytorch_lora_weights.safetensors"))
    assert a.keys() == b.keys()
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    scale = max(a[k].abs().max().item() for k in a if "up" in k)
    assert 0 < diff <= 1e-3 * scale, (diff, scale)  # different kernels: the same update to rounding
