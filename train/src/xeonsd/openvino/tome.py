"""``xeonsd export --tome RATIO``: token merging (ToMe) in the UNet's largest transformer blocks, traced into the IR.

Bipartite soft matching as in "Token Merging for Stable Diffusion" (Bolya & Hoffman 2023), written for a traced,
static-shape graph:

* the tokens of a block form its latent grid (``h x w``, row-major); in every 2x2 window one token is a
  destination (``b``), the others (and the rows/columns no full window covers) are sources (``a``). The paper draws
  the destination at random in each window and step; a traced graph needs it fixed, so it is drawn once from a
  seeded generator (``DST_SEED``): the same pseudo-random pattern in every export and every call;
* similarity: cosine between the block's input tokens (``a`` against ``b``); each source keeps its most similar
  destination, and the ``r = int(ratio x N)`` sources with the highest similarity are merged (averaged) into it;
* merge before the block's self-attention (and, with ``mlp``, before its feed-forward) and unmerge its output (a
  merged token's result is copied back to every token it holds): the attention runs on ``N - r`` tokens;
* only the blocks whose token count is the largest in the UNet (the highest-resolution level that has attention,
  like tomesd's ``max_downsample=1``), found by block type (diffusers' ``BasicTransformerBlock``) and by the token
  counts of a dry run at the export's shape, never by layer names: SD 1.x/2.x and SDXL alike.

The matching is a matmul, a max, an argsort and row gathers/scatters on tensors, so it is part of the exported
graph; the grid, ``r`` and the destination pattern are constants of the export's static shape (``--tome`` needs a
static export). Only the ``forward`` of the patched modules changes, never the module tree, so the IR's weight names
(which GenAI's LoRA adapters match) stay those of a plain export. Ratio 0 patches nothing: the export is exactly the plain one.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger(__name__)

MAX_RATIO = 0.75  # a 2x2 window keeps one destination: at most 3/4 of the tokens are sources
WINDOW = 2
DST_SEED = 0


class TomeError(ValueError):
    """The token merging cannot be done with these inputs."""


def check_ratio(value: Any) -> float:
    """``--tome RATIO``: a number in [0, MAX_RATIO]; anything else is one clear error."""
    try:
        ratio = float(value)
    except (TypeError, ValueError):
        raise TomeError(f"--tome must be a number between 0 and {MAX_RATIO}, got {value!r}") from None
    if not 0.0 <= ratio <= MAX_RATIO:  # also refuses nan
        raise TomeError(f"--tome must be between 0 and {MAX_RATIO} (the share of tokens merged), got {value!r}")
    return ratio


@dataclass(frozen=True)
class BlockPlan:
    """One patched block: its module name, token grid and how many tokens the merge removes."""

    name: str
    height: int
    width: int
    removed: int

    @property
    def tokens(self) -> int:
        return self.height * self.width

    @property
    def merged(self) -> int:
        return self.tokens - self.removed


@dataclass
class TomeReport:
    """What an export's token merging did (the manifest's ``tome`` entry)."""

    ratio: float
    mlp: bool
    blocks: list[BlockPlan] = field(default_factory=list)

    def manifest_entry(self) -> dict[str, Any]:
        return {
            "ratio": self.ratio,
            "mlp": self.mlp,
            "destination": f"one per {WINDOW}x{WINDOW} window, fixed pseudo-random (seed {DST_SEED})",
            "blocks": [{**asdict(b), "tokens": b.tokens, "merged_tokens": b.merged} for b in self.blocks],
        }


def partition(height: int, width: int, seed: int = DST_SEED) -> tuple[Any, Any]:
    """Token indices (row-major in the ``height x width`` grid) of the destinations, one per full 2x2 window at a
    seeded pseudo-random place, and of the sources (every other token); both ascending."""
    import torch

    rows, cols = height // WINDOW, width // WINDOW
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randint(WINDOW * WINDOW, (rows, cols), generator=gen)
    r = torch.arange(rows)[:, None] * WINDOW + pick // WINDOW
    c = torch.arange(cols)[None, :] * WINDOW + pick % WINDOW
    dst = (r * width + c).flatten().sort().values
    is_dst = torch.zeros(height * width, dtype=torch.bool)
    is_dst[dst] = True
    return dst, torch.nonzero(~is_dst).flatten()


def bipartite_matching(metric: Any, dst: Any, src: Any, removed: int) -> tuple[Callable, Callable]:
    """``merge`` ([B, N, C] -> [B, N - removed, C]) and ``unmerge`` (back to [B, N, C]) for the tokens ``metric``
    holds ([B, N, C]): each source goes to its most similar destination (cosine), the ``removed`` most similar
    sources are averaged into theirs. Only N and the index tensors are constants; the batch is read from ``metric``.

    Written for the exported graph: every move of tokens is a gather or scatter of whole rows of the batch-flattened
    [B x N, C] tensor (OpenVINO ``Gather`` / ``ScatterNDUpdate`` on axis 0), never an index broadcast to every
    channel (``GatherElements`` / ``ScatterElementsUpdate``, which cost 2.5x as much in a 512 px SD 1.5 block);
    unmerge is one row gather through a read map built once per call, not a sort."""
    import torch

    # N and the index tensors are constants; the batch is never read as a number (the trace, at one batch size, must
    # hold at the export's static one): per-batch row offsets come from a cumsum over the batch dimension instead.
    n_src, n_dst = src.shape[0], dst.shape[0]
    tokens = n_src + n_dst  # the grid: every token is a source or a destination
    n_kept = n_src - removed
    normed = metric / metric.norm(dim=-1, keepdim=True)
    scores = normed.index_select(1, src) @ normed.index_select(1, dst).transpose(-1, -2)  # [B, Na, Nb]
    # max with its index (a k=1 TopK): among equal scores, which int8 similarities make common, the first
    # destination; an argmax written as compare-and-max (the last one) was 0.7 ms a block faster and made the hybrid
    # int8 UNet's output 11 % further from the plain one's (mean relative error 0.055 against 0.049).
    best, best_dst = scores.max(dim=-1)
    order = best.argsort(dim=-1, descending=True)  # sources, most similar first: the first `removed` are merged
    moved, kept = order[:, :removed], order[:, removed:]
    target = best_dst.gather(1, moved)  # [B, removed]: the destination each merged source joins
    batch_index = torch.ones_like(order[:, :1]).cumsum(0) - 1  # [B, 1]: 0, 1, ..., B-1
    source_rows = (src[order] + batch_index * tokens).flatten()  # rows of the flattened [B x N, C] input
    dst_rows = (dst + batch_index * tokens).flatten()
    target_rows = (target + batch_index * n_dst).flatten()  # rows of the flattened [B x Nb, C] destinations
    # unmerge: for each of the N tokens, the row of the flattened merged [B x (n_kept + Nb), C] tensor it reads
    # (``+ 0 * batch_index`` broadcasts a constant row to [B, ·] without reading B).
    positions = torch.cat([src[kept], src[moved], dst + 0 * batch_index], dim=1) + batch_index * tokens
    reads = torch.cat(
        [torch.arange(n_kept) + 0 * batch_index, n_kept + target, n_kept + torch.arange(n_dst) + 0 * batch_index],
        dim=1,
    )
    read = torch.zeros_like(positions.flatten())
    read.index_put_((positions.flatten(),), (reads + batch_index * (n_kept + n_dst)).flatten())
    # How many tokens each destination holds after the merge (itself and the sources merged into it): a function of
    # the matching only, so computed once for every tensor merged with it (the attention's and, with mlp, the FF's).
    count = torch.ones_like(metric[:, :n_dst, :1]).reshape(-1, 1)
    count.index_put_((target_rows,), torch.ones_like(target_rows, dtype=metric.dtype).unsqueeze(1), accumulate=True)

    def merge(x: Any) -> Any:
        ch = x.shape[-1]
        flat = x.reshape(-1, ch)
        a = flat.index_select(0, source_rows).reshape(-1, n_src, ch)  # the sources in `order`
        summed = flat.index_select(0, dst_rows)  # a fresh tensor: the merged sources are added into it in place
        summed.index_put_((target_rows,), a[:, :removed].reshape(-1, ch), accumulate=True)
        return torch.cat([a[:, removed:], (summed / count).reshape(-1, n_dst, ch)], dim=1)

    def unmerge(y: Any) -> Any:
        ch = y.shape[-1]
        return y.reshape(-1, ch).index_select(0, read).reshape(-1, tokens, ch)

    return merge, unmerge


def _patch_block(block: Any, plan: BlockPlan, mlp: bool) -> None:
    """Replace the ``forward`` of the block, its self-attention (and feed-forward) on this instance only."""
    dst, src = partition(plan.height, plan.width)
    current: dict[str, tuple[Callable, Callable]] = {}
    block_forward, attn_forward = block.forward, block.attn1.forward

    def forward(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        current["fns"] = bipartite_matching(hidden_states, dst, src, plan.removed)
        try:
            return block_forward(hidden_states, *args, **kwargs)
        finally:
            current.clear()

    def merged(inner: Callable) -> Callable:
        def call(x: Any, *args: Any, **kwargs: Any) -> Any:
            merge, unmerge = current["fns"]
            return unmerge(inner(merge(x), *args, **kwargs))

        return call

    block.forward = forward
    block.attn1.forward = merged(attn_forward)
    if mlp:
        block.ff.forward = merged(block.ff.forward)


def _grid(latent: tuple[int, int], tokens: int) -> tuple[int, int]:
    """The token grid of a block with ``tokens`` tokens in a UNet run on a ``latent`` (h, w) sample."""
    h, w, d = latent[0], latent[1], 1
    while math.ceil(h / d) * math.ceil(w / d) > tokens:
        d *= 2
    grid = (math.ceil(h / d), math.ceil(w / d))
    if grid[0] * grid[1] != tokens:
        raise TomeError(f"a transformer block has {tokens} tokens, no downsampled grid of the {h}x{w} latent")
    return grid


def token_counts(unet: Any, inputs: dict[str, Any]) -> dict[str, int]:
    """The token count of every ``BasicTransformerBlock`` in ``unet``, from one forward on ``inputs``."""
    import torch
    from diffusers.models.attention import BasicTransformerBlock

    counts: dict[str, int] = {}

    def record(name: str) -> Callable:
        def hook(_module: Any, args: tuple, kwargs: dict) -> None:
            counts.setdefault(name, int((args[0] if args else kwargs["hidden_states"]).shape[1]))

        return hook

    hooks = [
        module.register_forward_pre_hook(record(name), with_kwargs=True)
        for name, module in unet.named_modules()
        if isinstance(module, BasicTransformerBlock)
    ]
    try:
        with torch.no_grad():
            unet(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return counts


def apply(unet: Any, inputs: dict[str, Any], ratio: float, mlp: bool = False) -> TomeReport:
    """Patch the blocks of ``unet`` whose token count is the largest for a run on ``inputs`` (``sample`` [B, C, h,
    w] and the rest of the UNet's arguments); return what was patched. Ratio 0 patches nothing."""
    ratio = check_ratio(ratio)
    report = TomeReport(ratio=ratio, mlp=mlp)
    if ratio == 0:
        return report
    one = {k: _first(v) for k, v in inputs.items()}  # the counts do not depend on the batch
    counts = token_counts(unet, one)
    if not counts:
        raise TomeError(f"--tome: the UNet ({type(unet).__name__}) has no transformer blocks to merge tokens in")
    latent = tuple(int(s) for s in inputs["sample"].shape[-2:])
    largest = max(counts.values())
    modules = dict(unet.named_modules())
    for name, tokens in counts.items():
        if tokens != largest:
            continue
        height, width = _grid(latent, tokens)  # type: ignore[arg-type]
        plan = BlockPlan(name, height, width, int(ratio * tokens))
        if plan.removed == 0 or min(height, width) < WINDOW:
            continue
        _patch_block(modules[name], plan, mlp)
        report.blocks.append(plan)
    log.info(
        "ToMe ratio %g: %d block(s) at %d tokens merge to %d",
        ratio,
        len(report.blocks),
        largest,
        report.blocks[0].merged if report.blocks else largest,
    )
    return report


def _first(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _first(v) for k, v in value.items()}
    return value[:1] if hasattr(value, "shape") and len(value.shape) > 0 else value


@contextlib.contextmanager
def export_patch(ratio: float, mlp: bool, latent: tuple[int, int]) -> Iterator[TomeReport]:
    """While optimum-intel exports inside this block, its UNet is traced at the static ``latent`` (h, w) size
    (optimum-intel traces at ``sample_size - 1`` and leaves height and width dynamic; a merge's constants must be
    those of the shape the IR runs at) with token merging applied; the yielded report says what was patched."""
    from diffusers import UNet2DConditionModel
    from optimum.exporters.openvino.model_configs import UNetOpenVINOConfig

    report = TomeReport(ratio=check_ratio(ratio), mlp=mlp)
    if report.ratio == 0:
        yield report
        return
    dummies, patcher = UNetOpenVINOConfig.generate_dummy_inputs, UNetOpenVINOConfig.patch_model_for_export

    def generate_dummy_inputs(self: Any, framework: str = "pt", **kwargs: Any) -> dict[str, Any]:
        import torch

        inputs = dummies(self, framework=framework, **kwargs)
        sample = inputs["sample"]
        inputs["sample"] = torch.randn((*sample.shape[:2], *latent), dtype=sample.dtype)
        return inputs

    def patch_model_for_export(self: Any, model: Any, model_kwargs: Any = None) -> Any:
        if isinstance(model, UNet2DConditionModel):
            done = apply(model, self.generate_dummy_inputs(framework="pt"), report.ratio, mlp)
            report.blocks.extend(done.blocks)
        return patcher(self, model, model_kwargs=model_kwargs)

    UNetOpenVINOConfig.generate_dummy_inputs = generate_dummy_inputs
    UNetOpenVINOConfig.patch_model_for_export = patch_model_for_export
    try:
        yield report
    finally:
        UNetOpenVINOConfig.generate_dummy_inputs = dummies
        UNetOpenVINOConfig.patch_model_for_export = patcher
    if not report.blocks:
        raise TomeError("--tome: the export traced no UNet transformer block to merge tokens in")
