"""The offline pipelines of the open-weight families with Qwen text encoders: FLUX.2-klein (``Flux2KleinPipeline``),
Z-Image (``ZImagePipeline``) and Qwen-Image (``QwenImagePipeline``), one :class:`OpenArch` per
``make-tiny-model --arch``, built with random weights.

* ``tiny-flux2`` / ``flux2-klein``: FLUX.2-klein-4B (distilled). ``Flux2Transformer2DModel`` (double- then
  single-stream blocks, 4-axis rotary positions, no guidance embedding), ``AutoencoderKLFlux2`` (32 latent
  channels, patchified 2x2 to 128 and batch-normalised), a ``Qwen3ForCausalLM`` whose hidden states 9, 18 and 27
  are stacked into the context (so even the tiny encoder has 28 layers), the flow-matching scheduler.
* ``tiny-zimage`` / ``zimage``: Z-Image-Turbo (6B). ``ZImageTransformer2DModel`` (single-stream, 2x2 patches,
  noise and caption refiner blocks), FLUX.1's 16-channel ``AutoencoderKL``, a Qwen3 encoder whose second-last
  hidden state is the context, ``FlowMatchEulerDiscreteScheduler`` with a fixed shift of 3.
* ``tiny-qwenimage`` / ``qwenimage``: Qwen-Image (20B MMDiT). ``QwenImageTransformer2DModel``, the Wan-style causal
  3D ``AutoencoderKLQwenImage`` (16 channels, per-channel latent mean/std), ``Qwen2_5_VLForConditionalGeneration``
  (vision tower included) whose last hidden state, less the 34-token system prompt, is the context.

The tiny archs make 64 px images in a few seconds on two cores (latent 8x8, 16 image tokens) and take a few MB.
The full archs have the released widths in bf16; ``--depth D`` cuts the denoiser's blocks (FLUX.2-klein: D
double-stream and 4D single-stream, as the real 5 + 20; Z-Image: D main layers, the 2 + 2 refiners kept;
Qwen-Image: D of 60), since the full ones do not fit 24 GB. Their text encoders are always the real size
(Qwen3-4B: 8 GB in bf16; Qwen2.5-VL-7B: 16.6 GB), the cut only applies to the denoiser.
Tokenizers and encoders: :mod:`.open_text`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xeonsd.assets.flow_models import FLUX_SHIFT, check_depth
from xeonsd.assets.open_text import QwenText, QwenVision, qwen3_encoder, qwen25vl_encoder, qwen_tokenizer
from xeonsd.assets.parts import default_dtype, vae_of
from xeonsd.fsutil import atomic_dir

log = logging.getLogger(__name__)

# Qwen-Image's VAE statistics (the released config's latents_mean / latents_std, also diffusers' defaults).
QWEN_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508)
QWEN_LATENTS_MEAN += (0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
QWEN_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743)
QWEN_LATENTS_STD += (3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)


@dataclass(frozen=True)
class OpenArch:
    """Dimensions of a generated pipeline (``family``: ``flux2``, ``zimage`` or ``qwenimage``)."""

    family: str
    layers: int  # FLUX.2: double-stream blocks; Z-Image: main layers; Qwen-Image: MMDiT blocks
    heads: int
    head_dim: int
    axes_dims_rope: tuple[int, ...]
    text: QwenText
    vae_channels: tuple[int, ...]  # Qwen-Image: base_dim * dim_mult
    vae_layers: int
    norm_groups: int = 32
    single_layers: int = 0  # FLUX.2
    refiner_layers: int = 0  # Z-Image
    axes_lens: tuple[int, ...] = ()  # Z-Image
    sample_px: int = 1024  # the VAE's sample_size: the default image side
    weights_dtype: str = "float32"

    def with_depth(self, depth: int) -> OpenArch:
        """The widths of ``self`` with ``depth`` denoiser blocks (FLUX.2: and 4x as many single-stream ones);
        ``depth`` as :func:`xeonsd.assets.flow_models.check_depth` allows it."""
        return dataclasses.replace(self, layers=depth, single_layers=4 * depth if self.family == "flux2" else 0)


_QWEN3_4B = QwenText(
    hidden=2560,
    layers=36,
    heads=32,
    kv_heads=8,
    intermediate=9728,
    head_dim=128,
    vocab_size=151936,
    tie_embeddings=True,
)
_QWEN25_VL_7B = QwenText(
    hidden=3584,
    layers=28,
    heads=28,
    kv_heads=4,
    intermediate=18944,
    vocab_size=152064,
    max_positions=128000,
    mrope_section=(16, 24, 24),
    vision=QwenVision(depth=32, hidden=1280, intermediate=3420, heads=16, fullatt_blocks=(7, 15, 23, 31)),
)
_TINY_VISION = QwenVision(depth=2, hidden=16, intermediate=32, heads=2, fullatt_blocks=(1,))

OPEN_ARCHS: dict[str, OpenArch] = {
    # FLUX.2-klein-4B: 5 double + 20 single blocks, 24 heads x 128, context = 3 x Qwen3-4B's 2560 (diffusers'
    # scripts/convert_flux2_to_diffusers.py, "klein-4b").
    "flux2-klein": OpenArch(
        family="flux2",
        layers=5,
        single_layers=20,
        heads=24,
        head_dim=128,
        axes_dims_rope=(32, 32, 32, 32),
        text=_QWEN3_4B,
        vae_channels=(128, 256, 512, 512),
        vae_layers=2,
        weights_dtype="bfloat16",
    ),
    # Z-Image-Turbo: 30 layers (+ 2 noise and 2 caption refiners) 3840 wide, 30 heads x 128, Qwen3-4B.
    "zimage": OpenArch(
        family="zimage",
        layers=30,
        refiner_layers=2,
        heads=30,
        head_dim=128,
        axes_dims_rope=(32, 48, 48),
        axes_lens=(1536, 512, 512),
        text=_QWEN3_4B,
        vae_channels=(128, 256, 512, 512),
        vae_layers=2,
        weights_dtype="bfloat16",
    ),
    # Qwen-Image: 60 MMDiT blocks, 24 heads x 128, Qwen2.5-VL-7B; VAE base_dim 96 x (1, 2, 4, 4).
    "qwenimage": OpenArch(
        family="qwenimage",
        layers=60,
        heads=24,
        head_dim=128,
        axes_dims_rope=(16, 56, 56),
        text=_QWEN25_VL_7B,
        vae_channels=(96, 192, 384, 384),
        vae_layers=2,
        weights_dtype="bfloat16",
    ),
    # The same structures at the tiny pipelines' size (64 px), for the tests.
    "tiny-flux2": OpenArch(
        family="flux2",
        layers=1,
        single_layers=2,
        heads=2,
        head_dim=16,
        axes_dims_rope=(4, 4, 4, 4),
        text=QwenText(hidden=32, layers=28, heads=2, kv_heads=1, intermediate=64, head_dim=16, tie_embeddings=True),
        vae_channels=(8, 8, 16, 16),
        vae_layers=1,
        norm_groups=8,
        sample_px=64,
    ),
    "tiny-zimage": OpenArch(
        family="zimage",
        layers=2,
        refiner_layers=2,
        heads=2,
        head_dim=16,
        axes_dims_rope=(4, 6, 6),
        axes_lens=(1536, 512, 512),
        text=QwenText(hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64, head_dim=16, tie_embeddings=True),
        vae_channels=(8, 8, 16, 16),
        vae_layers=1,
        norm_groups=8,
        sample_px=64,
    ),
    "tiny-qwenimage": OpenArch(
        family="qwenimage",
        layers=2,
        heads=2,
        head_dim=16,
        axes_dims_rope=(4, 6, 6),
        text=QwenText(
            hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64, mrope_section=(2, 3, 3), vision=_TINY_VISION
        ),
        vae_channels=(8, 16, 32, 32),
        vae_layers=1,
        sample_px=64,
    ),
}


def make_open_model(out: Path, arch: str, seed: int = 0, depth: int | None = None, configs_only: bool = False) -> Path:
    """Write a random-weight FLUX.2-klein, Z-Image or Qwen-Image pipeline directory of ``arch`` to ``out``.
    ``configs_only``: the same directory without weights (the models built on the meta device, their configs, the
    tokenizer and model_index.json written): what ``xeonsd train --dry_run`` and doctor's memory row read, for the
    architectures this machine cannot hold (Qwen-Image: 20 B + 8 B parameters)."""
    import contextlib

    import torch
    from accelerate import init_empty_weights

    if arch not in OPEN_ARCHS:
        raise ValueError(f"unknown open --arch {arch!r}; choose one of {sorted(OPEN_ARCHS)}")
    check_depth(arch, depth)  # (the one rule for --depth)
    a = OPEN_ARCHS[arch] if depth is None else OPEN_ARCHS[arch].with_depth(depth)
    out = Path(out)
    torch.manual_seed(seed)
    tokenizer = qwen_tokenizer()
    # Built in this order from one seed: the weights depend on it.
    empty = init_empty_weights() if configs_only else contextlib.nullcontext()
    with default_dtype(getattr(torch, a.weights_dtype)), empty:
        transformer = _TRANSFORMERS[a.family](a)
        vae = _VAES[a.family](a)
        encode = qwen25vl_encoder if a.family == "qwenimage" else qwen3_encoder
        text_encoder = encode(a.text, tokenizer)
    pipe = _pipeline(a, transformer, vae, text_encoder, tokenizer)
    with atomic_dir(out) as tmp:
        if configs_only:
            _save_configs(pipe, tmp)
        else:
            pipe.save_pretrained(tmp, safe_serialization=True)
    n = sum(p.numel() for p in transformer.parameters())
    what = "configs" if configs_only else "pipeline"
    log.info("wrote %s %s to %s (transformer %.1fM parameters)", arch, what, out, n / 1e6)
    return out


def _save_configs(pipe: Any, out: Path) -> None:
    """A pipeline directory without weights: model_index.json, each component's config, the tokenizer."""
    pipe.save_config(out)  # model_index.json
    for name, part in pipe.components.items():
        if hasattr(part, "save_config"):  # diffusers models and schedulers
            part.save_config(out / name)
        elif hasattr(part, "save_pretrained") and not hasattr(part, "parameters"):  # tokenizers
            part.save_pretrained(out / name)
        else:  # transformers models: the config (and its generation config, where it has one)
            part.config.save_pretrained(out / name)
            if getattr(part, "generation_config", None) is not None:
                part.generation_config.save_pretrained(out / name)


def _pipeline(a: OpenArch, transformer: Any, vae: Any, text_encoder: Any, tokenizer: Any) -> Any:
    from diffusers import Flux2KleinPipeline, QwenImagePipeline, ZImagePipeline

    parts = {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer}
    scheduler = _scheduler(a)
    if a.family == "flux2":  # klein-4B is step-distilled: no classifier-free guidance
        return Flux2KleinPipeline(scheduler=scheduler, is_distilled=True, **parts)
    if a.family == "zimage":  # Z-Image ships the bare Qwen3Model (what its pipeline and training script load)
        return ZImagePipeline(scheduler=scheduler, **{**parts, "text_encoder": text_encoder.model})
    return QwenImagePipeline(scheduler=scheduler, **parts)


def _flux2_transformer(a: OpenArch) -> Any:
    from diffusers import Flux2Transformer2DModel

    assert sum(a.axes_dims_rope) == a.head_dim, "FLUX.2's rotary axes split the head dimension"
    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * 32,  # 32 latent channels patchified 2x2
        num_layers=a.layers,
        num_single_layers=a.single_layers,
        attention_head_dim=a.head_dim,
        num_attention_heads=a.heads,
        joint_attention_dim=3 * a.text.hidden,  # three stacked encoder layers
        timestep_guidance_channels=256,
        mlp_ratio=3.0,
        axes_dims_rope=a.axes_dims_rope,
        rope_theta=2000,
        eps=1e-6,
        guidance_embeds=False,
    )


def _zimage_transformer(a: OpenArch) -> Any:
    from diffusers import ZImageTransformer2DModel

    assert sum(a.axes_dims_rope) == a.head_dim, "Z-Image's rotary axes split the head dimension"
    return ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=a.heads * a.head_dim,
        n_layers=a.layers,
        n_refiner_layers=a.refiner_layers,
        n_heads=a.heads,
        n_kv_heads=a.heads,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=a.text.hidden,
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=list(a.axes_dims_rope),
        axes_lens=list(a.axes_lens),
    )


def _qwenimage_transformer(a: OpenArch) -> Any:
    from diffusers import QwenImageTransformer2DModel

    assert sum(a.axes_dims_rope) == a.head_dim, "Qwen-Image's rotary axes split the head dimension"
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * 16,  # 16 latent channels packed 2x2
        out_channels=16,
        num_layers=a.layers,
        attention_head_dim=a.head_dim,
        num_attention_heads=a.heads,
        joint_attention_dim=a.text.hidden,
        guidance_embeds=False,
        axes_dims_rope=a.axes_dims_rope,
    )


def _flux2_vae(a: OpenArch) -> Any:
    from diffusers import AutoencoderKLFlux2

    n = len(a.vae_channels)
    return AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=a.vae_channels,
        layers_per_block=a.vae_layers,
        latent_channels=32,
        norm_num_groups=a.norm_groups,
        sample_size=a.sample_px,
        use_quant_conv=True,
        use_post_quant_conv=True,
        batch_norm_eps=1e-4,
        patch_size=(2, 2),
    )


def _zimage_vae(a: OpenArch) -> Any:
    # FLUX.1's autoencoder: 16 channels, scaling and shift factors, no quant convs.
    return vae_of(a.vae_channels, a.vae_layers, a.norm_groups, a.sample_px, 0.3611, shift=0.1159)


def _qwenimage_vae(a: OpenArch) -> Any:
    from diffusers import AutoencoderKLQwenImage

    base = a.vae_channels[0]
    return AutoencoderKLQwenImage(
        base_dim=base,
        z_dim=16,
        dim_mult=[c // base for c in a.vae_channels],
        num_res_blocks=a.vae_layers,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        latents_mean=list(QWEN_LATENTS_MEAN),
        latents_std=list(QWEN_LATENTS_STD),
    )


_TRANSFORMERS = {"flux2": _flux2_transformer, "zimage": _zimage_transformer, "qwenimage": _qwenimage_transformer}
_VAES = {"flux2": _flux2_vae, "zimage": _zimage_vae, "qwenimage": _qwenimage_vae}


def _scheduler(a: OpenArch) -> Any:
    """The released models' scheduler configs (FLUX.2 and Qwen-Image shift with the resolution, the pipeline
    passing ``mu``; Z-Image-Turbo has a fixed shift of 3)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if a.family == "flux2":
        return FlowMatchEulerDiscreteScheduler(**FLUX_SHIFT, time_shift_type="exponential")
    if a.family == "zimage":
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    return FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
