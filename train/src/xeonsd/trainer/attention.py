"""The denoiser's attention in a training step: torch's ``scaled_dot_product_attention``, with the queries folded
into the batch where the backward would leave the rank's threads idle (``--attention fold``, the default).

PyTorch's CPU flash-attention backward (``cpu_flash_attention_backward``, aten/src/ATen/native/cpu/
FlashAttentionKernel.cpp) hands each thread whole (batch, head) pairs; its forward also splits the queries. At
batch 1, SD 1.5's 8 heads keep 8 of a 28-thread rank's threads busy in the backward and leave 20 idle. Folding
splits the queries into blocks and makes each block a batch entry of its own with the whole keys and values: the
same maths (softmax runs over each query's row of keys, and a query's row does not depend on the other queries),
B x H x blocks pairs for the threads. The keys and values are broadcast views (no copy at batch 1); the backward
sums each block's key and value gradients. :func:`query_blocks` chooses the blocks (1: plain SDPA) from integers
only, memoised, so the call costs nothing where nothing is folded.

:func:`attention` is the drop-in for ``F.scaled_dot_product_attention``; :func:`routed_attention` routes the
calls of the code inside it (diffusers' attention processors, its ``dispatch_attention_fn``, transformers' SDPA
attention: they all call ``torch.nn.functional.scaled_dot_product_attention``) through it. The training step runs
its forward and backward inside (a gradient-checkpointed block's forward runs again in the backward and must fold
the same way). What is not folded, exactly as torch runs it: no gradient wanted, not CPU (the memory estimate's
meta forward), causal attention, dropout, grouped-query attention, a mask that needs a gradient or does not
broadcast as SDPA's rules say.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from xeonsd.trainer.config import ATTENTION_KINDS

# The kernel's query tile: 256 rows from 768 queries up, 64 from 192, else 32 (FlashAttentionKernel.cpp). The
# backward's time per unit of work on the smaller tiles, against the 256-row one (one 8-head layer, 4096 and 1024
# tokens, head dim 40, 2 threads, Zen 4, torch 2.13: bf16 1.35-1.72x and 2.0-2.4x, fp32 1.12-1.28x and 1.44-1.77x).
_TILES = ((768, 1.0), (192, 1.5), (0, 2.2))
MIN_BLOCK_ROWS = 192  # no block of the 32-row tile: they cost twice as much and are too small to be worth a fold
# Fold only when the backward is predicted at least this much faster: a fold that balances nothing (8 heads on 2
# threads in 2 blocks) measured 0.92-1.08x, so smaller predicted gains could be lost to it.
MIN_GAIN = 1.2


def _tile_cost(rows: int) -> float:
    return next(cost for least, cost in _TILES if rows >= least)


def backward_cost(entries: int, threads: int, tokens: int, blocks: int) -> float:
    """The flash backward's predicted time with the queries in ``blocks`` blocks, in units of one (batch, head)
    pair's whole backward on the 256-row tile: the kernel splits its ``entries`` x ``blocks`` pairs evenly over the
    threads in consecutive chunks of ceil(pairs / threads), so a thread runs that many pairs of 1/blocks the work."""
    rows = -(-tokens // blocks)
    return -(-entries * blocks // threads) / blocks * _tile_cost(rows)


@functools.lru_cache(maxsize=4096)
def query_blocks(batch: int, heads: int, threads: int, tokens: int) -> int:
    """How many query blocks to fold into the batch (1: none) for an attention of ``batch`` x ``heads`` with
    ``tokens`` queries on ``threads`` threads: the count of the lowest :func:`backward_cost` (the fewest blocks of
    equal cost), blocks of at least :data:`MIN_BLOCK_ROWS` rows and at most one per thread, taken when it is at
    least :data:`MIN_GAIN` times faster than no fold. Pairs that are a multiple of the threads are never folded:
    every thread already has equal work."""
    entries = batch * heads
    if entries < 1 or threads < 2 or entries % threads == 0 or tokens < 2 * MIN_BLOCK_ROWS:
        return 1
    most = min(threads, tokens // MIN_BLOCK_ROWS)
    best = min(range(1, most + 1), key=lambda n: (backward_cost(entries, threads, tokens, n), n))
    plain = backward_cost(entries, threads, tokens, 1)
    return best if plain >= MIN_GAIN * backward_cost(entries, threads, tokens, best) else 1


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch's own SDPA (the C function behind ``F.scaled_dot_product_attention``, which :func:`routed_attention`
    replaces); ``enable_gqa`` only when set (torch < 2.5 has no such argument)."""
    extra = {"enable_gqa": True} if enable_gqa else {}
    return torch._C._nn.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **extra
    )


def _mask_folds(mask: torch.Tensor | None, b: int, h: int, queries: int, keys: int) -> bool:
    """Whether a mask can be cut per query block: none, or one that needs no gradient and broadcasts to
    [batch, heads, queries, keys] (SDPA's rule) with its query dimension 1 or all the queries."""
    if mask is None:
        return True
    if mask.requires_grad or mask.dim() > 4:
        return False
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    return all(m in (1, full) for m, full in zip(shape, (b, h, queries, keys), strict=True))


def blocks_for(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False) -> int:
    """The query blocks :func:`attention` folds this call into (1: plain SDPA): :func:`query_blocks` for this
    rank's threads where folding is exact and pays (a backward will run: grad mode on and an input that wants a
    gradient), else 1."""
    if is_causal or dropout_p or enable_gqa or not torch.is_grad_enabled():
        return 1
    if not (query.requires_grad or key.requires_grad or value.requires_grad):
        return 1
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.device.type != "cpu":
        return 1
    b, h, queries, _ = query.shape
    if key.shape[:2] != (b, h) or value.shape[:2] != (b, h):
        return 1
    # under --compile, dynamo traces the function (it warns about the cache wrapper and ignores it anyway)
    choose = query_blocks.__wrapped__ if torch.compiler.is_compiling() else query_blocks
    blocks = choose(b, h, torch.get_num_threads(), queries)
    if blocks > 1 and not _mask_folds(attn_mask, b, h, queries, key.shape[2]):
        return 1
    return blocks


def _pad_queries(t: torch.Tensor, pad: int, fill: float | bool) -> torch.Tensor:
    """``t`` [..., queries, x] with ``pad`` more query rows of ``fill``, laid out as diffusers lays out its
    queries ([batch, tokens, heads, dim] in memory), so the fold after it is a view."""
    rows = t.new_full((*t.shape[:-2], pad, t.shape[-1]), fill).transpose(1, 2)
    return torch.cat([t.transpose(1, 2), rows], dim=1).transpose(1, 2)


def _fold(t: torch.Tensor, blocks: int) -> torch.Tensor:
    """[b, h, blocks x rows, x] -> [b x blocks, h, rows, x], block j of batch entry i at i x blocks + j (a view when
    the strides allow, as diffusers' [batch, tokens, heads, dim] layout does)."""
    return t.unflatten(2, (blocks, -1)).transpose(1, 2).flatten(0, 1)


def _repeat(t: torch.Tensor, blocks: int) -> torch.Tensor:
    """[b, ...] -> [b x blocks, ...], each entry once per block (a broadcast view at b = 1)."""
    return t.unsqueeze(1).expand(t.shape[0], blocks, *t.shape[1:]).flatten(0, 1)


def _fold_mask(mask: torch.Tensor, b: int, blocks: int, pad: int) -> torch.Tensor:
    """The mask of the folded call: per block its rows (a mask with a row per query, padded with rows that mask
    nothing) or the one row all queries share, repeated per block where it differs per batch entry."""
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    if mask.shape[2] == 1:
        return mask if mask.shape[0] == 1 else _repeat(mask, blocks)
    if pad:
        mask = _pad_queries(mask, pad, True if mask.dtype == torch.bool else 0.0)
    return _fold(mask.expand(b, *mask.shape[1:]), blocks)


def fold_queries(query, key, value, blocks: int, attn_mask=None, scale=None) -> torch.Tensor:
    """SDPA of [b, h, queries, d] inputs with the queries cut into ``blocks`` blocks of ceil(queries / blocks) rows
    (the last padded with zero queries, whose rows are dropped: their output gradient is 0, so they add nothing to
    the key and value gradients), each block a batch entry of its own with all the keys and values."""
    if blocks == 1:
        return _sdpa(query, key, value, attn_mask=attn_mask, scale=scale)
    b, _, queries, _ = query.shape
    rows = -(-queries // blocks)
    pad = rows * blocks - queries
    q = _pad_queries(query, pad, 0.0) if pad else query
    mask = None if attn_mask is None else _fold_mask(attn_mask, b, blocks, pad)
    out = _sdpa(_fold(q, blocks), _repeat(key, blocks), _repeat(value, blocks), attn_mask=mask, scale=scale)
    out = out.unflatten(0, (b, blocks)).transpose(1, 2).flatten(2, 3)
    return out[:, :, :queries] if pad else out


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention``'s drop-in (same arguments, by position or by name): the queries folded
    into the batch where :func:`blocks_for` says so, torch's SDPA unchanged everywhere else."""
    blocks = blocks_for(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if blocks == 1:
        return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return fold_queries(query, key, value, blocks, attn_mask, scale)


@contextlib.contextmanager
def routed_attention(kind: str = "fold") -> Iterator[None]:
    """Inside: ``F.scaled_dot_product_attention`` is :func:`attention` (``kind`` "fold") or torch's own ("sdpa").
    The training step's forward and backward run inside."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention {kind!r}; choose one of {', '.join(ATTENTION_KINDS)}")
    if kind == "sdpa":
        yield
        return
    from unittest import mock

    with mock.patch.object(F, "scaled_dot_product_attention", attention):
        yield
