"""The benchmarks' yardsticks: attention FLOPs are counted on CPU, and one matmul peak serves both benchmarks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from xeonsd.flops import count_cpu_ops, matmul_peak


def test_cpu_flash_attention_is_counted_forward_and_backward():
    b, h, n, d = 1, 2, 128, 40
    q = torch.randn(b, h, n, d, requires_grad=True)
    with FlopCounterMode(display=False) as before:
        F.scaled_dot_product_attention(q, q, q).sum().backward()
    count_cpu_ops()
    count_cpu_ops()  # idempotent
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


def test_the_int8_frozen_layers_products_are_counted():
    """--base_precision int8's torch._int_mm: 2·m·k·n, forward and the input gradient's product, as a bf16 layer's."""
    from xeonsd.trainer.methods.int8_base import Int8Linear

    count_cpu_ops()
    m, k, n = 32, 64, 48
    layer = torch.nn.Linear(k, n, bias=False)
    x = torch.randn(m, k, requires_grad=True)
    with FlopCounterMode(display=False) as plain:
        layer(x).sum().backward()
    quantized = Int8Linear(layer)
    y = torch.randn(m, k, requires_grad=True)
    with FlopCounterMode(display=False) as int8:
        quantized(y).sum().backward()
    counts = int8.get_flop_counts()["Global"]
    assert counts.get(torch.ops.aten._int_mm, 0) > 0, counts
    # the frozen layer's weight takes no gradient: the forward and the input gradient, 2 products of 2·m·k·n
    assert int8.get_total_flops() == 2 * (2 * m * k * n) == plain.get_total_flops() - 2 * m * k * n
