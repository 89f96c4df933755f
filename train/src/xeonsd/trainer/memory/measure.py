"""What the memory estimates stand on (the package for the UNet families, :mod:`.flow` for the flow ones):
the estimate's record, the meta-device helpers that count saved activations, the allocator term and the process's
own footprint."""

from __future__ import annotations

import contextlib
import dataclasses
import resource
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from xeonsd.cluster.memory import resident_bytes

GB = 1e9


ESTIMATE_FILE = "memory_estimate.json"  # rank 0 writes the estimate in --output_dir (bench train reads it)


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    gradients: int
    optimizer: int
    activations: int
    caches: int
    runtime: int
    loading: int = 0  # the peak while the models load (see _loading)
    allocator: int = 0  # what glibc's malloc keeps beyond the live activations (0 under tcmalloc): _allocator
    # Of ``weights`` and ``loading``: the frozen weights that --share_weights maps from one file per node (counted
    # once per node, not per rank: :meth:`per_node`).
    shared_training: int = 0
    shared_loading: int = 0
    # Of ``loading``: what the rank that reads the denoiser holds beyond it while it does (its largest tensor as
    # stored, or from_pretrained's stored copy); with shared weights only the rank that builds the file holds it.
    loading_transient: int = 0

    @property
    def training(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self) if f.name not in _NOT_TRAINING)

    @property
    def total(self) -> int:
        return max(self.training, self.loading)

    def per_node(self, ranks: int, shared: bool) -> int:
        """The peak of ``ranks`` ranks on one node: each rank's total, or with shared weights the shared bytes
        once plus each rank's private bytes, in the loading phase and in training (whichever is larger)."""
        return max(self.per_node_phases(ranks, shared))

    def per_node_phases(self, ranks: int, shared: bool) -> tuple[int, int]:
        """(loading, training) peaks of ``ranks`` ranks on one node (:meth:`per_node`)."""
        if not shared:
            return ranks * self.loading, ranks * self.training
        training = self.shared_training + ranks * (self.training - self.shared_training)
        own_loading = self.loading - self.shared_loading - self.loading_transient
        return self.shared_loading + ranks * own_loading + self.loading_transient, training

    def describe(self) -> str:
        parts = ", ".join(f"{f.name} {getattr(self, f.name) / GB:.2f}" for f in fields(self) if f.name in _TERMS)
        return (
            f"{self.total / GB:.2f} GB (training {self.training / GB:.2f}: {parts}; loading {self.loading / GB:.2f}; "
            f"shareable frozen weights {self.shared_training / GB:.2f} in training, {self.shared_loading / GB:.2f} "
            "loading)"
        )

    def as_dict(self) -> dict[str, int]:
        """The figures in bytes (``memory_estimate.json``), with the training and total sums."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "training": self.training, "total": self.total}


def in_phases(
    cfg, method: str, first: tuple[int, int], stays: tuple[int, int], denoiser: tuple[int, int, int], apart: int = 0
):
    """(loading, of it shareable, of it transient): the models' peak while they load. Every model at once, or with
    phased loading (:func:`xeonsd.trainer.models.loads_in_phases`) the larger of the text encoders' and the VAE's
    phase and the denoiser's beside what stays loaded. ``first``, ``stays``: (bytes, of them shareable);
    ``denoiser``: (its loading bytes, of them shareable, of them transient); ``apart``: of ``first``, the smaller
    of the two groups of text encoders that load one after the other in phases (a flow family's long encoder,
    then its CLIP ones), shareable."""
    from xeonsd.trainer.methods import method_class
    from xeonsd.trainer.models import loads_in_phases

    if loads_in_phases(cfg, method_class(method).text_first(cfg) is not None, None):
        first = (first[0] - apart, first[1] - apart)
        last = (stays[0] + denoiser[0], stays[1] + denoiser[1])
        return (*first, 0) if first[0] > last[0] else (*last, denoiser[2])
    return first[0] + denoiser[0], first[1] + denoiser[1], denoiser[2]


def shard_if_asked(cfg, est: MemoryEstimate, world: int, denoiser: torch.nn.Module, trainable: int) -> MemoryEstimate:
    """The estimate of one of ``world`` ranks: :func:`sharded_over` when the run shards the trained denoiser (--fsdp
    on 2+ ranks, a full fine-tune), else ``est``."""
    from xeonsd.trainer.sharding import shards, unit_sizes

    if not shards(cfg, world):
        return est
    largest = max(unit_sizes(denoiser))
    return sharded_over(est, world, trainable, largest)


def sharded_over(est: MemoryEstimate, world: int, trainable: int, largest_unit: int) -> MemoryEstimate:
    """--fsdp over ``world`` ranks: the trained fp32 weights, their gradients and the optimizer state 1/world per
    rank, plus the whole weights of two units (:func:`xeonsd.trainer.sharding.shard_units`: the one running and the
    next, prefetched) and one unit's whole gradients before they are reduce-scattered. While the models load each
    rank holds the whole denoiser and copies its shards out of it: with --share_weights the node's ranks map one
    whole copy, and each holds its shards beside it."""
    own = trainable * 4
    return dataclasses.replace(
        est,
        weights=est.weights - own + own // world + 2 * largest_unit * 4,
        gradients=est.gradients // world + largest_unit * 4,
        optimizer=est.optimizer // world,
        loading=est.loading + own // world,
        shared_loading=est.shared_loading + own,
    )


_NOT_TRAINING = ("loading", "shared_training", "shared_loading", "loading_transient")
_TERMS = ("weights", "gradients", "optimizer", "activations", "caches", "runtime", "allocator")


def available_memory() -> int | None:
    """Bytes this node can still give (MemAvailable), or None where /proc/meminfo does not say."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def _numel(module: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


class _SavedBytes:
    """Sums the bytes of the distinct tensors autograd saves; per top-level UNet block as well."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        self.total = 0
        # The weights an op keeps for its backward are counted as weights already (a cast copy under autocast is
        # not one of them, and counts).
        self.seen: dict[int, torch.Tensor] = {id(w): w for w in weights}
        self.block_start = 0
        self.blocks: list[tuple[int, int]] = []  # (saved bytes inside the block, bytes of its input)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in self.seen:
            self.seen[id(base)] = base  # keeps the object alive, so its id is not reused
            self.total += base.numel() * base.element_size()
        return t

    def watch(self, block: torch.nn.Module) -> None:
        def pre(_m, args):
            self.block_start = self.total

        def post(_m, args, _out):
            first = args[0] if args else None
            size = first.numel() * first.element_size() if isinstance(first, torch.Tensor) else 0
            self.blocks.append((self.total - self.block_start, size))

        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)


def saved_activations(model: torch.nn.Module, blocks, cfg, autocast: bool, *args, **kwargs) -> int:
    """What autograd keeps in one meta forward of ``model(*args, **kwargs)``, watched per block of ``blocks``: every
    saved tensor, plus the largest block's again for the gradients the backward holds while it passes through that
    block. With --gradient_checkpointing a block's activations exist only while it is recomputed: each block's
    input is kept instead, plus the largest block's activations and their gradients."""
    saved = _SavedBytes(list(model.parameters()))
    for block in blocks:
        saved.watch(block)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), amp, _cpu_attention():
        model(*args, **kwargs)
    largest = max((b for b, _ in saved.blocks), default=0)
    if not getattr(cfg, "gradient_checkpointing", False):
        return saved.total + largest
    inside = sum(b for b, _ in saved.blocks)
    return saved.total - inside + sum(i for _, i in saved.blocks) + 2 * largest


@contextlib.contextmanager
def _cpu_attention():
    """On meta tensors SDPA takes the math path, which keeps the whole score matrix for the backward (GBs at
    512 px); CPU tensors take the flash kernel, which keeps only the output and the log-sum-exp. Route the meta
    forward to the flash kernel so the saved tensors are the ones a real step keeps."""
    from unittest import mock

    import torch.nn.functional as F

    plain = F.scaled_dot_product_attention

    def flash(q=None, k=None, v=None, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        # diffusers' attention dispatch (the transformers') passes them by name, with enable_gqa=False
        q, k, v = kw.pop("query", q), kw.pop("key", k), kw.pop("value", v)
        if kw.pop("enable_gqa", False) and k.shape[-3] != q.shape[-3]:
            # grouped-query attention (Krea 2): the CPU flash kernel takes it too; here each query head gets its
            # keys and values, which keeps a little more than the real step (k and v at the query heads' count)
            k, v = (t.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) for t in (k, v))
        if attn_mask is not None or dropout_p or kw:
            return plain(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)[0]

    with mock.patch.object(F, "scaled_dot_product_attention", flash):
        yield


# glibc's malloc keeps about a quarter of the step's activations beyond the live bytes (freed blocks it does not
# return): measured on SD3.5-medium LoRA at 512 px, the resident growth over a step was 1.24x the activations under
# glibc and 0.74x under tcmalloc, and at 1024 px at least 1.22x under glibc (docs/benchmarks.md).
GLIBC_ACTIVATION_SHARE = 0.25


def tcmalloc_loaded() -> bool:
    """Whether this process allocates through tcmalloc (preloaded, as the cluster's env.sh does)."""
    with contextlib.suppress(OSError):
        return "libtcmalloc" in Path("/proc/self/maps").read_text()
    return False


def _allocator(activations: int) -> int:
    """The estimate's allocator term: 0 under tcmalloc, else :data:`GLIBC_ACTIVATION_SHARE` of the activations."""
    return 0 if tcmalloc_loaded() else int(GLIBC_ACTIVATION_SHARE * activations)


def step_batch(cfg) -> int:
    """The examples one step of a rank runs through the UNet: ``--train_batch_size``, twice that with prior
    preservation (each instance example is paired with a class example in the same forward pass)."""
    return cfg.train_batch_size * (2 if cfg.with_prior_preservation else 1)


def _text_encoders(src: str, kw: dict, family) -> list[tuple[object, torch.nn.Module]]:
    """(config, meta-device model) of each of the family's text encoders; the last with its projection when the
    family conditions on its pooled output (SDXL); a flow family's T5 with its own config."""
    import transformers
    from transformers import CLIPTextConfig

    out = []
    for i, sub in enumerate(family.text_encoders):
        cls = getattr(transformers, family.spec.text_encoder_class(i))
        config_cls = CLIPTextConfig if cls.config_class is None else cls.config_class
        config = config_cls.from_pretrained(src, subfolder=sub, **kw)
        with torch.device("meta"):
            out.append((config, cls(config)))
    return out


def _resident_bytes() -> int:
    """This process's resident memory now (the interpreter, torch and the libraries: the estimate's runtime). Not
    ru_maxrss: Linux carries a launcher's high-water mark across fork and exec, so a rank started by a large process
    (a benchmark holding a model) would count that process's memory as its own."""
    now = resident_bytes()
    return now if now is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _unet_loading(cfg, numel: int, nbytes: int, subfolder: str) -> int:
    """The UNet's bytes while it loads. Local safetensors weights are read tensor by tensor into their dtype
    (trainer.weights): the model plus its largest tensor as stored. Otherwise ``from_pretrained`` reads every
    weight as stored and then casts it: both copies exist until the load ends."""
    from xeonsd.trainer.weights import largest_tensor_bytes, local_weight_files

    src = cfg.pretrained_model_name_or_path
    files = local_weight_files(src, subfolder, cfg.variant, cfg.revision)
    if files is not None:
        return numel * nbytes + largest_tensor_bytes(files)
    cast = numel * nbytes
    unet_files = list((Path(src).expanduser() / subfolder).glob("*.safetensors"))
    stored = sum(f.stat().st_size for f in unet_files) if unet_files else numel * 4
    same_dtype = abs(stored - cast) < 0.01 * cast  # stored as it is used: no second copy
    return stored + (0 if same_dtype else cast)
