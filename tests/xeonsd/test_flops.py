"""The benchmarks' yardsticks: attention FLOPs are counted on CPU, and one matmul peak serves both benchmarks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from xeonsd.flops import count_attention, matmul_peak


def test_cpu_flash_attention_is_counted_forward_and_backward():
    b, h, n, d = 1, 2, 128, 40
    q = torch.randn(b, h, n, d, requires_grad=True)
    with FlopCounterMode(display=False) as before:
        F.scaled_dot_product_attention(q, q, q).sum().backward()
    count_attention()
    count_attention()  # idempotent
    with FlopCounterMode(display=False) as after:
        F.scaled_dot_product_attention(q, q, q).sum().backward()
    forward = 4 * b * h * n * n * d  # QK^T and PV
    backward = 10 * b * h * n * n * d  # the scores recomputed, and the four products of the gradients
    assert after.get_total_flops() - before.get_total_flops() == forward + backward


def test_both_benchmarks_use_the_same_matmul_peak(monkeypatch):
    """``bench train`` and ``bench generate`` both probe through xeonsd.bench.rounds.probes: fp32 and bf16
    alternating, each through xeonsd.flops."""
    import xeonsd.flops as flops
    from xeonsd.bench import rounds

    calls = []
    monkeypatch.setattr(flops, "matmul_rates", lambda dtype, n, s: calls.append((dtype, n, s)) or {256: 2.0, 512: 3.0})
    probes = rounds.probes(2, 0.5, max_n=512)
    assert [(p["dtype"], p["peak"]) for p in probes] == [("fp32", 3.0), ("bf16", 3.0)] * 2
    assert calls == [(torch.float32, 512, 0.5), (torch.bfloat16, 512, 0.5)] * 2
    monkeypatch.undo()
    peak = matmul_peak(torch.float32, max_n=256, seconds=0.1)
    assert 1e8 < peak < 1e15  # a real measurement of a 256 x 256 product, in FLOP/s
