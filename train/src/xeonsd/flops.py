"""What the benchmarks measure work against: the matmul peak of this CPU, and FLOP counts that include attention.

Both benchmarks (``bench train``, ``bench generate``) use the one peak function, so their "share of peak"
figures are comparable. PyTorch's FLOP counter has no formula for the CPU flash-attention kernels that
``scaled_dot_product_attention`` runs on CPU tensors, so it counted attention as 0; ``count_cpu_ops()``
registers PyTorch's own SDPA formulas for them (forward 4·b·h·q·k·d; backward 10·b·h·q·k·d: the scores
recomputed, and the four products of the gradients), and ``torch._int_mm``'s (2·m·k·n), the products of the int8
frozen layers of ``--base_precision int8``.
"""

from __future__ import annotations

import math
import time

import torch


def matmul_peak(dtype: torch.dtype, max_n: int = 4096, seconds: float = 2.0) -> float:
    """Best FLOP/s of a square ``dtype`` matmul over sizes 256, 512, … up to ``max_n`` (see ``matmul_rates``)."""
    return max(matmul_rates(dtype, max_n, seconds).values())


def matmul_rates(dtype: torch.dtype, max_n: int = 4096, seconds: float = 2.0) -> dict[int, float]:
    """Best FLOP/s of a square ``dtype`` matmul at each size 256, 512, … up to ``max_n``.

    The size doubles while one product takes under 0.25 s, so an emulated dtype (bf16 without AMX or AVX512-BF16
    runs ~100x slower than fp32) stops at a small product instead of running for minutes; every size gets its
    share of ``seconds`` and at least 3 repetitions, after one untimed product (its kernel selection)."""
    sizes = []
    n = 256
    while n <= max_n:
        sizes.append(n)
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        t0 = time.perf_counter()
        a @ b
        if time.perf_counter() - t0 > 0.25:
            break
        n *= 2
    rates: dict[int, float] = {}
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b  # warm-up: the first product of a size pays for its kernel selection
        start, reps, best = time.perf_counter(), 0, 0.0
        while reps < 3 or time.perf_counter() - start < seconds / len(sizes):
            t0 = time.perf_counter()
            a @ b
            best = max(best, 2 * n**3 / (time.perf_counter() - t0))
            reps += 1
        rates[n] = best
    return rates


def matmul_probes(
    dtypes: dict[str, torch.dtype], repeats: int = 3, max_n: int = 4096, seconds: float = 1.0
) -> list[dict]:
    """``repeats`` probes of each dtype, the dtypes alternating: ``{"dtype", "peak", "rates"}`` in FLOP/s, rates
    per matrix side (several sizes each). Benchmarks take them before and after their variants
    (xeonsd.bench.rounds.stability judges whether the machine held still)."""
    probes = []
    for _ in range(repeats):
        for name, dtype in dtypes.items():
            rates = matmul_rates(dtype, max_n, seconds)
            probes.append({"dtype": name, "peak": max(rates.values()), "rates": {str(n): r for n, r in rates.items()}})
    return probes


def count_cpu_ops() -> None:
    """Teach ``torch.utils.flop_counter`` the CPU ops it does not know (idempotent): the flash-attention kernels,
    forward and backward, and ``torch._int_mm``, the int8 products of ``--base_precision int8``'s frozen layers
    (2·m·k·n integer operations, counted as FLOPs: a step's count stays the step's work, which a share of the
    bf16 peak then reads as if it ran at the bf16 rate)."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    fwd, bwd = (
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_flash_attention_for_cpu_backward,
    )
    if fwd not in fc.flop_registry and fwd.default not in fc.flop_registry:

        @fc.register_flop_formula(fwd)
        def _forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return fc.sdpa_flop_count(query_shape, key_shape, value_shape)

        @fc.register_flop_formula(bwd)
        def _backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return fc.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)

    if aten._int_mm not in fc.flop_registry and aten._int_mm.default not in fc.flop_registry:

        @fc.register_flop_formula(aten._int_mm)
        def _int_mm(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
            return fc.mm_flop(a_shape, b_shape)


def allreduced_elements(prof) -> int:
    """Elements all-reduced in a ``torch.profiler`` recording: every ``<backend>:all_reduce`` event (gloo, ccl),
    DistributedDataParallel's buckets included, with the shapes the profiler recorded."""
    events = (e for e in prof.events() if e.name.endswith(":all_reduce"))
    return sum(math.prod(shape) for e in events for shape in e.input_shapes if shape)
