"""The estimated peak memory of one training rank, before any weight is loaded.

The models are built from their configs on PyTorch's ``meta`` device (shapes and dtypes, no data), so weights,
gradients and optimizer state are counted exactly. Activations are measured, not guessed: one forward pass of the
meta UNet at the run's resolution and batch (twice ``--train_batch_size`` with prior preservation), with the method's trainable parts, records every tensor autograd
keeps for the backward pass (``saved_tensors_hooks``), plus the largest block's again for the gradients the backward
holds while it passes through that block. With ``--gradient_checkpointing`` only each block's input is kept, plus
the largest block's activations (and their gradients) while it is recomputed. The process's own footprint (Python, the
libraries) is its resident size when the estimate is made. Without tcmalloc preloaded, glibc's malloc keeps about a
quarter of the activations again (the ``allocator`` term).

Where memory is estimated, in one place: this module (:func:`estimate`, the UNet families' terms and the node-wide
check), :mod:`.flow` (the flow families' terms, from their training side's shapes) and :mod:`.measure` (the record,
the meta-device activation counter, the allocator term and the process's own footprint).
"""

from __future__ import annotations

import torch

from xeonsd.trainer.memory.measure import (
    ESTIMATE_FILE,
    GB,
    GLIBC_ACTIVATION_SHARE,
    MemoryEstimate,
    _allocator,
    _numel,
    _resident_bytes,
    _text_encoders,
    _unet_loading,
    available_memory,
    in_phases,
    saved_activations,
    shard_if_asked,
    step_batch,
)

__all__ = [
    "ESTIMATE_FILE",
    "GB",
    "GLIBC_ACTIVATION_SHARE",
    "available_memory",
    "check_fits",
    "estimate",
]


def _activations(unet, cfg, cross_dim: int, hidden_grad: bool, autocast: bool, pooled_dim: int = 0) -> int:
    """What autograd keeps in one meta forward of the UNet (:func:`.measure.saved_activations`, per block)."""
    batch = step_batch(cfg)
    side = cfg.resolution // 8
    dtype = next(unet.parameters()).dtype
    x = torch.zeros(batch, unet.config.in_channels, side, side, device="meta", dtype=dtype)
    h = torch.zeros(batch, 77, cross_dim, device="meta", dtype=dtype, requires_grad=hidden_grad)
    t = torch.zeros(batch, dtype=torch.long, device="meta")
    added = None
    if pooled_dim:  # SDXL: the pooled text embedding and the six micro-conditioning numbers
        added = {
            "text_embeds": torch.zeros(batch, pooled_dim, device="meta", dtype=dtype),
            "time_ids": torch.zeros(batch, 6, device="meta", dtype=dtype),
        }
    blocks = [b for b in [*unet.down_blocks, unet.mid_block, *unet.up_blocks] if b is not None]
    return saved_activations(unet, blocks, cfg, autocast, x, t, h, added_cond_kwargs=added, return_dict=False)


def estimate(cfg, method: str, num_images: int, num_prompts: int, world: int = 1) -> MemoryEstimate:
    """Peak bytes of one rank of ``world`` for this configuration (the model's configs must be readable). Without
    --resolution, at the family's default (:func:`xeonsd.trainer.resolution.with_resolution`)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel

    from xeonsd.families import detect_family
    from xeonsd.trainer.methods import method_class
    from xeonsd.trainer.resolution import with_resolution

    src, kw = cfg.pretrained_model_name_or_path, {"revision": cfg.revision}
    family = detect_family(src, cfg.revision)
    cfg = with_resolution(cfg, family)
    if family.is_flow:
        from xeonsd.trainer.memory.flow import flow_estimate

        return flow_estimate(cfg, method, family, num_images, num_prompts, world)
    weight_dtype = torch.bfloat16 if cfg.mixed_precision == "bf16" else torch.float32
    wbytes = torch.finfo(weight_dtype).bits // 8
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(src, subfolder="unet", **kw))
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(src, subfolder="vae", **kw))
    encoders = _text_encoders(src, kw, family)
    text_bytes = sum(_numel(m) for _, m in encoders) * 4  # fp32
    unet.requires_grad_(False)
    terms = method_class(method)  # the method's own terms: what trains, where, and its optimizer state
    unet_dtype = torch.float32 if terms.unet_fp32 else weight_dtype
    torch.nn.Module.to(unet, unet_dtype)  # (ModelMixin.to warns about keep-in-fp32 modules SD has none of)
    trainable = terms.memory_trainable(cfg, unet, encoders, family)
    frozen_unet = _numel(unet) - (trainable if terms.trains_unet else 0)
    weights = text_bytes + frozen_unet * torch.finfo(unet_dtype).bits // 8
    if terms.trains_unet:  # fp32 tensors of their own (textual inversion's vectors sit in the text encoders)
        weights += trainable * 4
    if cfg.validation_prompt or not cfg.latent_cache:
        weights += _numel(vae) * wbytes
    gradients = trainable * 4
    optimizer = terms.memory_optimizer_bytes(cfg, trainable)
    autocast = weight_dtype == torch.bfloat16 and unet_dtype == torch.float32
    cross_dim = sum(c.hidden_size for c, _ in encoders)  # SDXL: both encoders' hidden states side by side
    pooled_dim = encoders[-1][0].projection_dim if family.spec.pooled else 0
    activations = _activations(unet, cfg, cross_dim, not terms.trains_unet, autocast, pooled_dim=pooled_dim)
    side = cfg.resolution // 8
    if cfg.with_prior_preservation:  # the class images' latents beside the instance ones, and the class prompt
        num_images, num_prompts = num_images + cfg.num_class_images, num_prompts + 1
    latents = 2 * num_images * 2 * 4 * side * side * 4
    if not cfg.latent_cache:
        latents = 2 * num_images * 3 * cfg.resolution**2 * 4
    prompts = num_prompts * (77 * cross_dim + pooled_dim) * 4 if terms.trains_unet else 0  # the frozen encoder's cache
    runtime = _resident_bytes()
    vae_bytes = _numel(vae) * wbytes
    unet_loading = _unet_loading(cfg, _numel(unet), torch.finfo(unet_dtype).bits // 8, "unet")
    # What --share_weights maps from the node's file: the frozen UNet (not a UNet that trains), the VAE, and the
    # text encoders (not with textual inversion, whose resized embedding tables are the rank's own: counted private)
    shared_text = 0 if method == "textual_inversion" else text_bytes
    shared_unet = 0 if terms.unet_fp32 else frozen_unet * torch.finfo(unet_dtype).bits // 8
    held_vae = vae_bytes if cfg.validation_prompt or not cfg.latent_cache else 0
    phases = in_phases(  # the CLIP text encoders stay
        cfg,
        method,
        (runtime + text_bytes + vae_bytes, shared_text + vae_bytes),
        (runtime + text_bytes + held_vae, shared_text + held_vae),
        (unet_loading, shared_unet, unet_loading - _numel(unet) * torch.finfo(unet_dtype).bits // 8),
    )
    est = MemoryEstimate(
        weights,
        gradients,
        optimizer,
        activations,
        latents + prompts,
        runtime,
        phases[0],
        _allocator(activations),
        shared_training=shared_text + shared_unet + held_vae,
        shared_loading=phases[1],
        loading_transient=phases[2],
    )
    return shard_if_asked(cfg, est, world, unet, trainable)


def check_fits(est: MemoryEstimate, ranks_on_node: int, available: int | None, shared: bool = False) -> str | None:
    """An error message when ``ranks_on_node`` ranks of this estimate do not fit in ``available`` bytes;
    ``shared``: the ranks map the frozen weights from one file per node (:meth:`MemoryEstimate.per_node`)."""
    node = est.per_node(ranks_on_node, shared)
    if available is None or node <= available:
        return None
    how = (
        f"{est.shared_loading / GB:.1f} GB of shared frozen weights + {ranks_on_node} rank(s) x their own"
        if shared
        else f"{est.total / GB:.1f} GB per rank x {ranks_on_node} rank(s) on this node"
    )
    return (
        f"the estimated peak memory is {how} = {node / GB:.1f} GB, but the node has {available / GB:.1f} GB free "
        "(MemAvailable); use fewer ranks per node, a smaller --train_batch_size or --resolution, "
        "--gradient_checkpointing, or --mixed_precision bf16"
    )
