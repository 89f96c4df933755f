"""The memory estimate of a flow family (FLUX.1, SD3, FLUX.2 [klein], Z-Image, Qwen-Image): :func:`flow_estimate`,
what :func:`xeonsd.trainer.memory.estimate` answers for them. The family's training side
(:attr:`xeonsd.families.FamilySpec.training`) gives the shapes: its latents, its text input, one call's inputs on the meta device
and the blocks whose saved activations repeat."""

from __future__ import annotations

import torch

from xeonsd.trainer.memory.measure import (
    MemoryEstimate,
    _allocator,
    _numel,
    _resident_bytes,
    _text_encoders,
    _unet_loading,
    in_phases,
    saved_activations,
    shard_if_asked,
    step_batch,
)


def flow_estimate(cfg, method: str, family, num_images: int, num_prompts: int, world: int = 1) -> MemoryEstimate:
    """:func:`xeonsd.trainer.memory.estimate` for a flow family: the transformer's meta forward at the run's
    resolution; the long text encoder (T5, Qwen) counts while the models load and the prompt tables are built, not
    in training (it is freed then, unless --shuffle_tags keeps it); the CLIP encoders stay (fp32)."""
    import diffusers

    from xeonsd.trainer.methods import method_class

    src, kw, spec = cfg.pretrained_model_name_or_path, {"revision": cfg.revision}, family.spec
    side = spec.training
    weight_dtype = torch.bfloat16 if cfg.mixed_precision == "bf16" else torch.float32
    wbytes = torch.finfo(weight_dtype).bits // 8
    denoiser_cls = getattr(diffusers, spec.denoiser_class)
    vae_cls = getattr(diffusers, spec.vae_class)
    with torch.device("meta"):
        denoiser = denoiser_cls.from_config(denoiser_cls.load_config(src, subfolder=spec.denoiser, **kw))
        vae = vae_cls.from_config(vae_cls.load_config(src, subfolder="vae", **kw))
    encoders = _text_encoders(src, kw, family)
    long, clips = encoders[-1][1], encoders[:-1]
    clip_bytes = sum(_numel(m) for _, m in clips) * 4  # fp32
    long_bytes = _numel(long) * wbytes  # loaded in the training dtype
    denoiser.requires_grad_(False)
    terms = method_class(method)
    dtype = torch.float32 if terms.unet_fp32 else weight_dtype
    torch.nn.Module.to(denoiser, dtype)
    trainable = terms.memory_trainable(cfg, denoiser, clips, family)
    weights = clip_bytes + (_numel(denoiser) - trainable) * torch.finfo(dtype).bits // 8 + trainable * 4
    weights += long_bytes if cfg.shuffle_tags else 0
    if cfg.validation_prompt or not cfg.latent_cache:
        weights += _numel(vae) * wbytes
    autocast = weight_dtype == torch.bfloat16 and dtype == torch.float32
    dims = side.latent_dims(vae.config, family.vae_scale, cfg.resolution, cfg.resolution)
    text_len = spec.clip_context_tokens + (spec.prompt_length_of(src) or 0)
    references = family.spec.reference_images if cfg.cond_image_column else 0  # at most this many per image
    activations = flow_activations(denoiser, side, cfg, dims, text_len, autocast, references)
    if cfg.with_prior_preservation:
        num_images, num_prompts = num_images + cfg.num_class_images, num_prompts + 1
    latents = 2 * num_images * 2 * dims[0] * dims[1] * dims[2] * 4
    if not cfg.latent_cache:
        latents = 2 * num_images * 3 * cfg.resolution**2 * 4
    latents *= 1 + references  # each image's reference images, held the same way
    # the tables, in the training dtype: the long encoder's hidden states, and the CLIP part (SD3: hidden states
    # of CLIP-L and CLIP-G side by side, 2048 wide, too)
    hidden_dim, pooled_dim = side.text_dims(denoiser.config)
    long_len = text_len - spec.clip_context_tokens
    prompts = num_prompts * (long_len * hidden_dim + spec.clip_context_tokens * 2048 + pooled_dim) * wbytes
    runtime = _resident_bytes()
    vae_bytes = _numel(vae) * wbytes
    denoiser_loading = _unet_loading(cfg, _numel(denoiser), torch.finfo(dtype).bits // 8, spec.denoiser)
    # What --share_weights maps from the node's file: the frozen denoiser (not one that trains), the VAE and every
    # text encoder
    shared_denoiser = 0 if terms.unet_fp32 else (_numel(denoiser) - trainable) * torch.finfo(dtype).bits // 8
    held = clip_bytes + (long_bytes if cfg.shuffle_tags else 0)
    held += vae_bytes if cfg.validation_prompt or not cfg.latent_cache else 0
    first = clip_bytes + long_bytes + vae_bytes  # every text encoder and the VAE (in phases: not both encoders)
    loading, shared_loading, transient = in_phases(
        cfg,
        method,
        (runtime + first, first),
        (runtime + held, held),  # the long text encoder freed (unless --shuffle_tags), the VAE once cached
        (denoiser_loading, shared_denoiser, denoiser_loading - _numel(denoiser) * torch.finfo(dtype).bits // 8),
        apart=min(clip_bytes, long_bytes),  # in phases the CLIP encoders load once the long one is freed
    )
    est = MemoryEstimate(
        weights,
        trainable * 4,
        terms.memory_optimizer_bytes(cfg, trainable),
        activations,
        latents + prompts,
        runtime,
        loading,
        _allocator(activations),
        shared_training=held + shared_denoiser,
        shared_loading=shared_loading,
        loading_transient=transient,
    )
    return shard_if_asked(cfg, est, world, denoiser, trainable)


def flow_activations(
    denoiser, side, cfg, dims: tuple[int, int, int], text_len: int, autocast: bool, references: int = 0
) -> int:
    """What autograd keeps in one meta forward of the transformer (:func:`.measure.saved_activations`, per
    block); ``side`` is the family's training side, ``references`` the reference images beside the latents."""
    dtype = next(denoiser.parameters()).dtype
    with torch.device("meta"):
        args = side.meta_inputs(denoiser.config, step_batch(cfg), dims, text_len, dtype, references)
    return saved_activations(denoiser, side.blocks(denoiser), cfg, autocast, **args, return_dict=False)
