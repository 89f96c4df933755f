"""``--fsdp``: a full fine-tune's denoiser sharded over all the job's ranks with PyTorch's FSDP2 (``fully_shard``).

Each rank keeps 1/world of every weight, of its gradient and of AdamW's two moments; a block's whole weights exist
only while that block runs (all-gathered before its forward and again before its backward, the gradients
reduce-scattered after it). The collectives go over the job's process group: gloo, or oneCCL where it is
installed. No DistributedDataParallel and no gradient all-reduce of our own: FSDP2 averages the gradients over the
ranks in the backward pass, as DistributedDataParallel does.

State leaves a sharded run in the layout a plain one writes: the whole weights by name and AdamW's state by
parameter name (``torch.distributed.checkpoint.state_dict``), so a checkpoint resumes on any number of ranks,
sharded or not, and the saved pipeline is an ordinary one. Gathering it is collective: every rank calls
:func:`full_weights` and :func:`full_optimizer_state`; rank 0 receives the tensors, the others an empty dict.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("xeonsd.train")


def shards(cfg, world: int | None = None) -> bool:
    """Whether the run shards its denoiser: --fsdp, a full fine-tune, 2+ ranks (on one there is nothing to shard);
    ``world``: the ranks (None: the process group's, or 1 without one)."""
    import torch.distributed as dist

    if world is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
    return getattr(cfg, "fsdp", False) and cfg.method == "full" and world > 1


# A block of any of the denoiser's block lists (at any depth: the UNet's down and up blocks, their resnets and
# attentions; a transformer's blocks), or a direct child outside them (the UNet's mid block), is a unit of its own
# when it holds at least this share of the weights; smaller ones stay in the unit around them.
_UNIT_SHARE = 0.01


def shard_units(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The units sharded (and gathered) one at a time, by name, innermost first (nested units are sharded before
    the units around them, as ``fully_shard`` needs). The root, the last unit, holds what no other unit does."""
    total = sum(p.numel() for p in module.parameters())
    names = {id(m): name for name, m in module.named_modules()}
    found: dict[int, torch.nn.Module] = {}
    candidates = [*(block for lst in module.modules() if isinstance(lst, torch.nn.ModuleList) for block in lst)]
    candidates += [child for child in module.children() if not isinstance(child, torch.nn.ModuleList)]
    for block in candidates:
        if sum(p.numel() for p in block.parameters()) >= _UNIT_SHARE * total:
            found[id(block)] = block
    return sorted(((names[i], m) for i, m in found.items()), key=lambda nm: -nm[0].count("."))


def unit_sizes(module: torch.nn.Module) -> list[int]:
    """The weights each unit gathers at once (its own, not those of the units inside it), the root's last."""
    units = [name for name, _ in shard_units(module)]
    sizes = dict.fromkeys([*units, ""], 0)
    for name, p in module.named_parameters():
        owner = max((u for u in units if name.startswith(u + ".")), key=len, default="")
        sizes[owner] += p.numel()
    return list(sizes.values())


def shard(module: torch.nn.Module) -> None:
    """Shard ``module``'s weights in place over every rank of the process group (each unit, then the root)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    units = shard_units(module)
    for _, unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(module, mesh=mesh)
    log.info(
        "--fsdp: the denoiser's weights, gradients and AdamW state sharded over %d ranks, %d units",
        mesh.size(),
        len(units) + 1,
    )


def is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def gradient_sync(module: torch.nn.Module, on: bool) -> None:
    """Whether the next backward reduce-scatters the gradients (off for every micro-batch but an optimizer step's
    last: they accumulate unreduced on this rank, as DistributedDataParallel's ``no_sync``)."""
    module.set_requires_gradient_sync(on)


def _options(module: torch.nn.Module):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # sharded: gathered to rank 0 only (one whole copy on the node that writes, none on the others)
    return StateDictOptions(full_state_dict=True, cpu_offload=is_sharded(module))


def full_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights by name, detached copies (rank 0; the other ranks of a sharded module get {})."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(module, options=_options(module))
    if is_sharded(module):
        return state
    return {k: v.detach().clone() for k, v in state.items()}


def load_full_weights(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Whole weights by name (a checkpoint of any rank count) into ``module``, sharded or not; every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True))


def full_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state keyed by parameter name (rank 0; {} on the other ranks of a sharded module)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer, options=_options(module))


def load_full_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """An optimizer state keyed by parameter name into ``optimizer``, sharded or not; every rank. A checkpoint
    written before the names (keyed by position) loads as it was written, into an unsharded module only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if all(isinstance(k, int) for k in state.get("state", {})):
        if is_sharded(module):
            from xeonsd.trainer.checkpoint import CheckpointError

            raise CheckpointError(
                "this checkpoint's optimizer state predates --fsdp's layout (by position, not by name); resume it "
                "without --fsdp once, and the next checkpoint resumes with it"
            )
        optimizer.load_state_dict(state)
        return
    set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))


def local_copy(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``whole`` laid out as ``like``: sharded as ``like`` is when it is a sharded weight (a DTensor)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(like, DTensor):
        return distribute_tensor(whole.to(like.dtype), like.device_mesh, like.placements)
    return whole


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded one (collective: every rank calls it), or ``t``."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
