"""``xeonsd bench optimizer``: one AdamW update, torch's default for CPU tensors (a loop over the tensors) against the
fused CPU kernel (``fused=True``, the trainer's default), interleaved A B A B in one process.

Two parameter sets: ``lora``, rank-4 adapters on the query/key/value/output projections of SD 1.5's 16 attention
blocks (their widths 320/640/1280: 797,184 parameters in 256 tensors, as the trainer counts them), and ``full``, ``--full-m`` million
parameters in 1280 x 1280 matrices (the whole SD 1.5 UNet, 860 M, needs 14 GB for weights, gradients and the two
moments). Each round times ``--updates`` updates of each implementation; the table gives the median s/update over
the rounds and the median of each round's loop / fused ratio. Figures are printed, not asserted.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from xeonsd.bench import rounds as rnd

IMPLS = ("per-tensor loop", "fused")
# SD 1.5's attention blocks: 2 per down/up level at 320, 640, 1280 (down 2+2+2, up 3+3+3) and 1 in the middle.
SD15_ATTENTION_WIDTHS = (320,) * 5 + (640,) * 5 + (1280,) * 6


def lora_shapes(rank: int = 4, text_dim: int = 768) -> list[tuple[int, ...]]:
    """Rank-``rank`` adapters (down, up) on q, k, v, out of self- and cross-attention of every block; the
    cross-attention's k and v read the text encoder's ``text_dim`` features."""
    shapes = []
    for w in SD15_ATTENTION_WIDTHS:
        for inputs in (w, w, w, w, w, text_dim, text_dim, w):  # self q k v out, cross q k v out
            shapes += [(rank, inputs), (w, rank)]
    return shapes


def full_shapes(million: float) -> list[tuple[int, ...]]:
    return [(1280, 1280)] * max(1, round(million * 1e6 / 1280**2))


def _optimizer(shapes: list[tuple[int, ...]], fused: bool) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=fused or None)
    opt.step()  # the moments are allocated by the first update
    return opt


def measure(shapes: list[tuple[int, ...]], rounds: int, updates: int) -> dict:
    """Per implementation, the s/update of each round (A B A B …), and the per-round ratio loop / fused."""
    opts = {name: _optimizer(shapes, fused=name == "fused") for name in IMPLS}
    times: dict[str, list[float]] = {name: [] for name in IMPLS}
    for _, name in rnd.schedule(list(IMPLS), rounds):
        t0 = time.perf_counter()
        for _ in range(updates):
            opts[name].step()
        times[name].append((time.perf_counter() - t0) / updates)
    return rnd.summarize(times, baseline="fused")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="xeonsd bench optimizer", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--updates", type=int, default=2, help="updates per implementation per round")
    p.add_argument("--full-m", type=float, default=135.0, help="million parameters of the 'full' set")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.updates < 1 or not args.full_m > 0:
        print(
            "xeonsd bench optimizer: error: --rounds and --updates must be at least 1, --full-m positive",
            file=sys.stderr,
        )
        return 2
    from xeonsd.cpu import cpu_info

    print(
        f"CPU: {cpu_info().model}; torch {torch.__version__}, {torch.get_num_threads()} threads; {args.rounds} "
        f"interleaved rounds; x fused: median of each round's s/update over the fused one's (min-max)"
    )
    print(
        f"{'set':<6}{'tensors':>9}{'M params':>10}{'implementation':>17}{'s/update':>10}{'x fused':>9}{'min-max':>12}"
    )
    for name, shapes in (("lora", lora_shapes()), ("full", full_shapes(args.full_m))):
        stats = measure(shapes, args.rounds, args.updates)
        n = sum(torch.Size(s).numel() for s in shapes) / 1e6
        for impl in IMPLS:
            st = stats[impl]
            print(
                f"{name:<6}{len(shapes):>9}{n:>10.1f}{impl:>17}{st['seconds']['median']:>10.4f}"
                f"{st['ratio']['median']:>9.2f} {rnd.range_text(st['ratio']):>11}",
                flush=True,
            )
    return 0
