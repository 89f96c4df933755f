"""``xeonsd bench attention``: one attention layer's forward and backward, torch's SDPA against the trainer's
(``--attention fold``: the queries folded into the batch where batch x heads leave threads idle,
xeonsd.trainer.attention), interleaved A B A B in one process.

The inputs are laid out as diffusers lays them out ([batch, tokens, heads, dim] in memory) and need gradients, as
in a training step. Each round times a forward and then its backward of each variant; the table gives the min and
median seconds over the rounds, the TFLOP/s and share of the matmul peak of the median (the FLOPs of torch's SDPA,
``torch.utils.flop_counter`` with :func:`xeonsd.flops.count_cpu_ops`: a fold's padding queries are not counted),
and the median of each round's ratio sdpa / fold per pass: the speed-up. The matmul peak of the dtype is probed
before and after the rounds (:mod:`xeonsd.bench.rounds`). Figures are printed, not asserted.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from xeonsd.bench import rounds as rnd

VARIANTS = ("sdpa", "fold")
PASSES = ("forward", "backward")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xeonsd bench attention", description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--tokens", type=int, required=True, help="queries (and keys, unless --keys)")
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--keys", type=int, default=None, help="keys and values (default: --tokens; 77: cross-attention)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, this process's)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds: each variant runs once per round")
    p.add_argument("--blocks", type=int, default=None, help="fold into this many query blocks (default: the trainer's)")
    p.add_argument("--peak-size", type=int, default=4096, help="largest matrix side of the matmul peak probes")
    p.add_argument("--probes", type=int, default=1, help="matmul peak probes, before and after the rounds")
    p.add_argument("--probe-seconds", type=float, default=1.0, help="seconds of products per probe (all its sizes)")
    return p


def _inputs(args: argparse.Namespace) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Query, key, value (leaves that need gradients) and the output's gradient, in diffusers' layout."""
    gen = torch.Generator().manual_seed(0)
    b, h, d, dtype = args.batch, args.heads, args.head_dim, DTYPES[args.dtype]
    shapes = ((b, args.tokens, h, d), (b, args.keys, h, d), (b, args.keys, h, d))
    qkv = [torch.randn(s, generator=gen).to(dtype).transpose(1, 2).requires_grad_() for s in shapes]
    grad_out = torch.randn(b, args.tokens, h, d, generator=gen).to(dtype).transpose(1, 2)
    return qkv, grad_out


def _timed(fn, qkv: list[torch.Tensor], grad_out: torch.Tensor) -> tuple[float, float]:
    """Seconds of ``fn(q, k, v)`` and of its backward."""
    for t in qkv:
        t.grad = None
    t0 = time.perf_counter()
    out = fn(*qkv)
    t1 = time.perf_counter()
    out.backward(grad_out)
    return t1 - t0, time.perf_counter() - t1


def flops(qkv: list[torch.Tensor], grad_out: torch.Tensor) -> dict[str, int]:
    """FLOPs of torch's SDPA forward and backward on these inputs (torch.utils.flop_counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    from xeonsd.flops import count_cpu_ops

    count_cpu_ops()
    counted = {}
    with FlopCounterMode(display=False) as fwd:
        out = torch.nn.functional.scaled_dot_product_attention(*qkv)
    counted["forward"] = fwd.get_total_flops()
    with FlopCounterMode(display=False) as bwd:
        out.backward(grad_out)
    counted["backward"] = bwd.get_total_flops()
    return counted


def measure(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Per variant and pass, the seconds of each round (A B A B …, one untimed warm-up call of each first). "fold"
    is the trainer's drop-in itself (its choice made per call), or the fold into ``--blocks`` blocks."""
    from xeonsd.trainer.attention import attention, fold_queries

    qkv, grad_out = _inputs(args)
    fns = {
        "sdpa": torch.nn.functional.scaled_dot_product_attention,
        "fold": attention if args.blocks is None else lambda q, k, v: fold_queries(q, k, v, args.blocks),
    }
    for name in VARIANTS:
        _timed(fns[name], qkv, grad_out)
    times: dict[str, dict[str, list[float]]] = {p: {v: [] for v in VARIANTS} for p in PASSES}
    for _, name in rnd.schedule(list(VARIANTS), args.rounds):
        for pass_, seconds in zip(PASSES, _timed(fns[name], qkv, grad_out), strict=True):
            times[pass_][name].append(seconds)
    return times


def _checked(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, or None."""
    sizes = (args.heads, args.tokens, args.head_dim, args.keys, args.batch, args.rounds, args.probes)
    if min(sizes) < 1 or (args.threads is not None and args.threads < 1):
        return "--heads, --tokens, --head-dim, --keys, --batch, --threads, --rounds and --probes must be at least 1"
    if args.blocks is not None and not 1 <= args.blocks <= args.tokens:
        return f"--blocks must be between 1 and --tokens ({args.tokens})"
    return None


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    args.keys = args.tokens if args.keys is None else args.keys
    wrong = _checked(args)
    if wrong:
        print(f"xeonsd bench attention: error: {wrong}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from xeonsd.cpu import cpu_info
    from xeonsd.flops import matmul_probes
    from xeonsd.trainer.attention import query_blocks

    cpu, threads = cpu_info(), torch.get_num_threads()
    chosen = query_blocks(args.batch, args.heads, threads, args.tokens)
    blocks = chosen if args.blocks is None else args.blocks
    rows = -(-args.tokens // blocks)
    bf16 = cpu.native_bf16 or "none: emulated"
    print(f"CPU: {cpu.model}; AMX: {'yes' if cpu.amx_bf16 else 'no'}; native bf16: {bf16}")
    print(f"torch {torch.__version__}, {threads} threads; {args.rounds} interleaved rounds (sdpa fold sdpa fold ...)")
    print(
        f"attention: batch {args.batch} x {args.heads} heads x {args.tokens} queries x {args.keys} keys, head dim "
        f"{args.head_dim}, {args.dtype}; fold: {blocks} query block(s) of {rows} rows "
        f"({'the trainer' if args.blocks is None else '--blocks'}; the trainer's choice here: {chosen})"
    )
    probe = {args.dtype: DTYPES[args.dtype]}
    before = matmul_probes(probe, args.probes, args.peak_size, args.probe_seconds)
    times = measure(args)
    after = matmul_probes(probe, args.probes, args.peak_size, args.probe_seconds)
    stable = rnd.stability(before, after)
    peak = stable["by_dtype"][args.dtype]["peak"]["median"]
    counted = flops(*_inputs(args))
    print(
        f"FLOP: forward {counted['forward'] / 1e9:.3f} G, backward {counted['backward'] / 1e9:.3f} G; "
        f"{args.dtype} matmul peak {peak / 1e12:.3f} TFLOP/s (median of {2 * args.probes} probes)"
    )
    print(f"{'variant':<9}{'pass':<10}{'min s':>10}{'median s':>10}{'TFLOP/s':>10}{'% of peak':>11}")
    for pass_ in PASSES:
        for name in VARIANTS:
            st = rnd.spread(times[pass_][name])
            rate = counted[pass_] / st["median"]
            print(
                f"{name:<9}{pass_:<10}{st['min']:>10.4f}{st['median']:>10.4f}{rate / 1e12:>10.3f}"
                f"{100 * rate / peak:>11.1f}"
            )
    for pass_ in PASSES:
        ratio = rnd.summarize(times[pass_], baseline="sdpa", invert=True)["fold"]["ratio"]
        print(
            f"ratio {pass_} sdpa/fold: {ratio['median']:.2f} median ({rnd.range_text(ratio)} over {args.rounds} "
            f"rounds){': the backward speed-up' if pass_ == 'backward' else ''}"
        )
    for line in rnd.verdict_lines(stable):
        print(line)
    return 0
