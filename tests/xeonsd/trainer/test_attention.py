"""``--attention fold`` (xeonsd.trainer.attention): the queries folded into the batch give torch's SDPA's outputs and
query, key and value gradients (exactly-close in fp32, within torch's own bf16 rounding in bf16), masks included;
folding happens only where batch x heads leave threads idle, never where it is not exact; and inside
``routed_attention`` diffusers' attention (its processors and its dispatch function) runs folded, a
gradient-checkpointed block too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from xeonsd.trainer.attention import MIN_BLOCK_ROWS, attention, blocks_for, query_blocks, routed_attention

FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"


@pytest.fixture
def threads():
    """Run with 4 torch threads (more than the test's heads), the process's count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield 4
    torch.set_num_threads(before)


def _qkv(b: int, h: int, queries: int, keys: int, d: int, dtype: torch.dtype, seed: int = 0):
    """Leaf query, key, value in diffusers' layout ([batch, tokens, heads, dim] in memory, seen as [b, h, L, d])."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ((b, queries, h, d), (b, keys, h, d), (b, keys, h, d))
    return [torch.randn(s, generator=gen).to(dtype).transpose(1, 2).requires_grad_() for s in shapes]


def _run(fn, qkv, grad_out, **kw):
    """The output and the query, key and value gradients of ``fn(q, k, v, **kw)``."""
    for t in qkv:
        t.grad = None
    out = fn(*qkv, **kw)
    out.backward(grad_out)
    return [out.detach(), *(t.grad for t in qkv)]


def _masks(b: int, h: int, queries: int, keys: int) -> dict[str, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(1)
    padding = torch.ones(b, keys, dtype=torch.bool)
    padding[-1, keys // 2 :] = False  # the last batch entry's keys half padding, as a text encoder's mask
    return {
        "none": None,
        "key padding [b,1,1,keys] bool": padding[:, None, None, :],
        "per query [queries,keys] bool": torch.rand(queries, keys, generator=gen) > 0.2,
        "per query and head [b,h,queries,keys] float": torch.randn(b, h, queries, keys, generator=gen),
    }


# ---- the choice ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch", "heads", "threads", "tokens", "blocks"),
    [
        (1, 8, 8, 4096, 1),  # heads = threads: every thread has a head
        (1, 16, 8, 4096, 1),  # a multiple of the threads: equal work already
        (2, 4, 8, 4096, 1),  # batch x heads counts, not heads
        (1, 8, 2, 4096, 1),
        (1, 8, 1, 4096, 1),  # one thread
        (1, 8, 28, 256, 1),  # too few queries for two blocks of MIN_BLOCK_ROWS
        (1, 24, 28, 4608, 1),  # FLUX on 28 threads: 24 of 28 busy; a fold would gain < MIN_GAIN
        (1, 8, 28, 4096, 3),  # SD 1.5 at 512 px on a 28-thread rank: 24 pairs, 24 threads, blocks of 1366 rows
        (1, 8, 28, 1024, 3),
        (1, 10, 28, 4096, 5),  # SDXL's 10 heads: 50 pairs in 2 rounds instead of 10 pairs of 5x the work
        (1, 1, 2, 4096, 2),
        (1, 1, 28, 4096, 21),  # as many blocks as MIN_BLOCK_ROWS allows
    ],
)
def test_query_blocks_fold_only_where_batch_times_heads_leave_threads_idle(batch, heads, threads, tokens, blocks):
    assert query_blocks(batch, heads, threads, tokens) == blocks


def test_folded_blocks_keep_the_minimum_rows_and_at_most_one_block_per_thread():
    for threads in (2, 4, 8, 28, 56, 112):
        for heads in (1, 2, 3, 5, 8, 10, 20, 24):
            for tokens in (300, 1024, 1536, 4096, 4608, 9216):
                n = query_blocks(1, heads, threads, tokens)
                assert n == 1 or (-(-tokens // n) >= MIN_BLOCK_ROWS and n <= threads), (heads, threads, tokens, n)
                if heads % threads == 0:
                    assert n == 1


def test_nothing_folds_where_folding_is_not_exact_or_no_backward_runs(threads):
    q, k, v = _qkv(1, 1, 1024, 1024, 16, torch.float32)
    assert blocks_for(q, k, v) == 4  # 1 pair, 4 threads: 4 blocks of 256 rows
    assert blocks_for(q, k, v, is_causal=True) == 1
    assert blocks_for(q, k, v, dropout_p=0.1) == 1
    assert blocks_for(q, k, v, enable_gqa=True) == 1
    assert blocks_for(q, k, v, attn_mask=torch.zeros(1, 1, 1024, 1024, requires_grad=True)) == 1
    assert blocks_for(q, k, v, attn_mask=torch.zeros(3, 1, 1, 1024)) == 1  # does not broadcast to the batch
    with torch.no_grad():
        assert blocks_for(q, k, v) == 1
    frozen = [t.detach() for t in (q, k, v)]
    assert blocks_for(*frozen) == 1
    meta = [t.detach().to("meta").requires_grad_() for t in (q, k, v)]
    assert blocks_for(*meta) == 1  # the memory estimate's meta forward: its own routing


# ---- the same attention --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mask", list(_masks(2, 1, 1001, 700)))
def test_folded_attention_is_sdpa_in_fp32(mask, threads):
    # 2 x 1 pairs on 4 threads, 1001 queries: 2 blocks of 501 rows, the last padded by one query
    qkv = _qkv(2, 1, 1001, 700, 16, torch.float32)
    attn_mask = _masks(2, 1, 1001, 700)[mask]
    assert blocks_for(*qkv, attn_mask=attn_mask) == 2
    grad_out = torch.randn(2, 1001, 1, 16).transpose(1, 2)
    ours = _run(attention, qkv, grad_out, attn_mask=attn_mask)
    plain = _run(F.scaled_dot_product_attention, qkv, grad_out, attn_mask=attn_mask)
    for name, a, b in zip(("output", "query grad", "key grad", "value grad"), ours, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    # the layout SDPA returns ([batch, tokens, heads, dim] in memory): the processors' reshape after it is a view
    assert ours[0].transpose(1, 2).reshape(2, 1001, 16).data_ptr() == ours[0].data_ptr()


@pytest.mark.parametrize("mask", ["none", "key padding [b,1,1,keys] bool"])
def test_folded_attention_is_sdpa_within_bf16_rounding(mask, threads):
    """bf16: against an fp64 reference, the folded call is off by torch's own bf16 SDPA's error plus the rounding of
    each block's key and value gradients to bf16 before the blocks are summed (at most 2^-8 of the largest gradient
    per block, and the sum's own rounding). Over 150 seeds the excess measured at most 2.14 of these units."""
    qkv = _qkv(1, 2, 1024, 1024, 16, torch.bfloat16)
    attn_mask = _masks(1, 2, 1024, 1024)[mask]
    blocks = blocks_for(*qkv, attn_mask=attn_mask)
    assert blocks == 2
    grad_out = torch.randn(1, 1024, 2, 16, generator=torch.Generator().manual_seed(2)).transpose(1, 2)
    ref_qkv = [t.detach().double().requires_grad_() for t in qkv]
    ref = _run(F.scaled_dot_product_attention, ref_qkv, grad_out.double(), attn_mask=attn_mask)
    ours = _run(attention, qkv, grad_out.bfloat16(), attn_mask=attn_mask)
    plain = _run(F.scaled_dot_product_attention, qkv, grad_out.bfloat16(), attn_mask=attn_mask)
    for name, a, b, r in zip(("output", "query grad", "key grad", "value grad"), ours, plain, ref, strict=True):
        ours_off, plain_off = (float((x.double() - r).abs().max()) for x in (a, b))
        rounding = (blocks + 1) * 2**-8 * float(r.abs().max())
        assert ours_off <= plain_off + rounding, f"{name}: folded {ours_off:.4f} off, torch's SDPA {plain_off:.4f}"


def test_causal_attention_is_left_to_sdpa_unchanged(threads):
    qkv = _qkv(1, 1, 512, 512, 16, torch.float32)
    grad_out = torch.randn(1, 512, 1, 16).transpose(1, 2)
    ours = _run(attention, qkv, grad_out, is_causal=True)
    plain = _run(F.scaled_dot_product_attention, qkv, grad_out, is_causal=True)
    for a, b in zip(ours, plain, strict=True):
        assert torch.equal(a, b)


# ---- the trainer's routing -----------------------------------------------------------------------------------------


def _flash_batches(fn) -> list[int]:
    """The batch size of every CPU flash-attention forward that ``fn()`` runs (torch.profiler's recorded shapes)."""
    with torch.profiler.profile(record_shapes=True) as prof:
        fn()
    return [e.input_shapes[0][0] for e in prof.events() if e.name == FLASH]


def test_routed_attention_folds_diffusers_attention_in_a_checkpointed_block(threads):
    """SD's attention (diffusers' ``Attention`` with its SDPA processor) and the transformers' (its
    ``dispatch_attention_fn``, native backend), one head of 512 tokens on 4 threads, the block gradient-checkpointed
    as --gradient_checkpointing does: inside ``routed_attention("fold")`` the forward and the recomputation in the
    backward run 2 blocks as 2 batch entries, and the gradients are ``routed_attention("sdpa")``'s."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.attention_processor import Attention

    torch.manual_seed(0)
    attn = Attention(query_dim=32, heads=1, dim_head=32)
    x = torch.randn(1, 512, 32)

    def block(hidden):
        out = attn(hidden)
        q = k = v = out.unflatten(-1, (1, 32))  # [batch, tokens, heads, dim], as the transformers call it
        return dispatch_attention_fn(q, k, v).flatten(2)

    def step(kind: str):
        attn.zero_grad(set_to_none=True)
        with routed_attention(kind):
            loss = checkpoint(block, x.requires_grad_(), use_reentrant=False).square().mean()
            loss.backward()
        return [p.grad.clone() for p in attn.parameters()]

    assert _flash_batches(lambda: step("sdpa")) == [1, 1, 1, 1]  # forward, and recomputed in the backward
    assert _flash_batches(lambda: step("fold")) == [2, 2, 2, 2]
    for a, b in zip(step("fold"), step("sdpa"), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention  # put back after
    with pytest.raises(ValueError, match="unknown attention 'flash'"), routed_attention("flash"):
        pass
