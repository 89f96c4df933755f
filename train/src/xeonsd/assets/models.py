"""The offline pipelines: one :class:`Arch` per ``make-tiny-model --arch``, built with random weights."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xeonsd.assets.parts import CLIP_G, CLIP_L, TINY_CLIP, TINY_CLIP_G, Clip, clip_model, vae_of
from xeonsd.assets.vocab import WORDS, build_clip_vocab, clip_tokenizer
from xeonsd.fsutil import atomic_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Arch:
    """Dimensions of a generated pipeline. With ``text2`` (OpenCLIP bigG in the real model, with its projection) it
    is an SDXL pipeline: two text encoders whose hidden states are concatenated for the cross-attention, and a UNet
    with ``text_time`` conditioning (the second encoder's pooled output and the six micro-conditioning numbers,
    each embedded in ``time_embed_dim``)."""

    unet_channels: tuple[int, ...]
    unet_layers: int
    unet_heads: int | tuple[int, ...]
    unet_down: tuple[str, ...]
    unet_up: tuple[str, ...]
    sample_size: int
    vae_channels: tuple[int, ...]
    vae_layers: int
    text: Clip
    vocab_size: int | None
    norm_groups: int
    prediction_type: str = "epsilon"
    linear_projection: bool = False
    text2: Clip | None = None
    transformer_layers: int | tuple[int, ...] = 1
    time_embed_dim: int = 0
    vae_scaling: float = 0.18215

    @property
    def sample_px(self) -> int:
        """The default image side: the UNet's sample size times the VAE's 8."""
        return self.sample_size * 8


ARCHS: dict[str, Arch] = {
    "tiny": Arch(
        unet_channels=(32, 64),
        unet_layers=1,
        unet_heads=2,
        unet_down=("CrossAttnDownBlock2D", "DownBlock2D"),
        unet_up=("UpBlock2D", "CrossAttnUpBlock2D"),
        sample_size=8,
        vae_channels=(8, 8, 16, 16),
        vae_layers=1,
        text=TINY_CLIP,
        vocab_size=None,
        norm_groups=8,
    ),
    "sd15": Arch(
        unet_channels=(320, 640, 1280, 1280),
        unet_layers=2,
        unet_heads=8,
        unet_down=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        unet_up=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        sample_size=64,
        vae_channels=(128, 256, 512, 512),
        vae_layers=2,
        text=CLIP_L,
        vocab_size=49408,
        norm_groups=32,
    ),
}
ARCHS["sd21"] = dataclasses.replace(
    ARCHS["sd15"],
    unet_heads=(5, 10, 20, 20),
    sample_size=96,
    text=Clip(hidden=1024, layers=23, heads=16, intermediate=4096, act="gelu"),
    prediction_type="v_prediction",
    linear_projection=True,
)
ARCHS["tiny-v"] = dataclasses.replace(
    ARCHS["tiny"],
    unet_heads=(2, 4),
    prediction_type="v_prediction",
    linear_projection=True,
    text=dataclasses.replace(TINY_CLIP, act="gelu"),
)
# SDXL base 1.0: UNet 2.57 B parameters (no attention at the first level, 1/2/10 transformer layers below),
# CLIP-L and OpenCLIP-bigG text encoders (123 M + 695 M), 1024 px, its VAE's scaling factor.
ARCHS["sdxl"] = Arch(
    unet_channels=(320, 640, 1280),
    unet_layers=2,
    unet_heads=(5, 10, 20),
    unet_down=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    unet_up=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    sample_size=128,
    vae_channels=(128, 256, 512, 512),
    vae_layers=2,
    text=CLIP_L,
    vocab_size=49408,
    norm_groups=32,
    linear_projection=True,
    text2=CLIP_G,
    transformer_layers=(1, 2, 10),
    time_embed_dim=256,
    vae_scaling=0.13025,
)
# The same structure at the tiny pipeline's size (64 px), for the tests.
ARCHS["tiny-xl"] = dataclasses.replace(
    ARCHS["tiny"],
    unet_heads=(2, 4),
    unet_down=("DownBlock2D", "CrossAttnDownBlock2D"),
    unet_up=("CrossAttnUpBlock2D", "UpBlock2D"),
    linear_projection=True,
    text2=TINY_CLIP_G,
    transformer_layers=(1, 2),
    time_embed_dim=8,
    vae_scaling=0.13025,
)


def arch_names() -> list[str]:
    """Every ``make-tiny-model --arch``: the UNet pipelines here, the FLUX.1/SD3 ones and the Qwen-encoder ones."""
    from xeonsd.assets.flow_models import FLOW_ARCHS
    from xeonsd.assets.open_models import OPEN_ARCHS

    return [*ARCHS, *FLOW_ARCHS, *OPEN_ARCHS]


def arch_resolution(arch: str) -> int:
    """The default image side of an ``--arch`` model (its denoiser's sample size x the VAE's scale)."""
    from xeonsd.assets.flow_models import FLOW_ARCHS
    from xeonsd.assets.open_models import OPEN_ARCHS

    return {**ARCHS, **FLOW_ARCHS, **OPEN_ARCHS}[arch].sample_px


def make_tiny_model(
    out: Path, arch: str = "tiny", seed: int = 0, depth: int | None = None, configs_only: bool = False
) -> Path:
    """Write a random-weight pipeline directory of the given architecture to ``out``: a
    ``StableDiffusionPipeline``, a ``StableDiffusionXLPipeline`` for the SDXL architectures, a FLUX.1 / SD3
    pipeline for the flow-matching ones (:mod:`xeonsd.assets.flow_models`; ``depth``: FLUX's block count), or a
    FLUX.2-klein / Z-Image / Qwen-Image one (:mod:`xeonsd.assets.open_models`; ``depth``: the denoiser's blocks;
    ``configs_only``: their configs without weights)."""
    import torch
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    from xeonsd.assets.flow_models import FLOW_ARCHS, check_depth, make_flow_model
    from xeonsd.assets.open_models import OPEN_ARCHS, make_open_model

    if configs_only and arch not in OPEN_ARCHS:
        raise ValueError(f"--configs-only is for {', '.join(sorted(OPEN_ARCHS))}, not --arch {arch}")
    if arch in FLOW_ARCHS:
        return make_flow_model(out, arch, seed=seed, depth=depth)
    if arch in OPEN_ARCHS:
        return make_open_model(out, arch, seed=seed, depth=depth, configs_only=configs_only)
    if arch not in ARCHS:
        raise ValueError(f"unknown --arch {arch!r}; choose one of {arch_names()}")
    check_depth(arch, depth)
    a = ARCHS[arch]
    out = Path(out)
    torch.manual_seed(seed)
    # Built in this order from one seed: the weights depend on it.
    unet = _unet(a)
    vae = _vae(a)
    vocab, merges = build_clip_vocab(list(WORDS), a.vocab_size)
    text_encoder = clip_model(a.text, vocab, projection=False)
    tokenizer = clip_tokenizer(vocab, merges)
    parts = {"unet": unet, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer, "scheduler": _scheduler(a)}
    if a.text2 is None:
        pipe = StableDiffusionPipeline(
            **parts, safety_checker=None, feature_extractor=None, requires_safety_checker=False
        )
    else:
        text_encoder_2 = clip_model(a.text2, vocab, projection=True)
        pipe = StableDiffusionXLPipeline(**parts, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer)
    with atomic_dir(out) as tmp:
        pipe.save_pretrained(tmp, safe_serialization=True)
    n_unet = sum(p.numel() for p in unet.parameters())
    log.info("wrote %s pipeline to %s (UNet %.1fM parameters, vocab %d)", arch, out, n_unet / 1e6, len(vocab))
    return out


def _unet(a: Arch) -> Any:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=a.sample_size,
        in_channels=4,
        out_channels=4,
        block_out_channels=a.unet_channels,
        layers_per_block=a.unet_layers,
        down_block_types=a.unet_down,
        up_block_types=a.unet_up,
        cross_attention_dim=a.text.hidden + (a.text2.hidden if a.text2 else 0),
        attention_head_dim=a.unet_heads,
        norm_num_groups=a.norm_groups,
        use_linear_projection=a.linear_projection,
        transformer_layers_per_block=a.transformer_layers,
        **_text_time(a),
    )


def _text_time(a: Arch) -> dict[str, Any]:
    """SDXL's added conditioning: the pooled text embedding and 6 micro-conditioning numbers (original size, crop
    top-left, target size), each number embedded in ``time_embed_dim`` channels."""
    if a.text2 is None:
        return {}
    return {
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": a.time_embed_dim,
        "projection_class_embeddings_input_dim": a.text2.hidden + 6 * a.time_embed_dim,
    }


def _vae(a: Arch) -> Any:
    return vae_of(a.vae_channels, a.vae_layers, a.norm_groups, a.sample_px, a.vae_scaling)


def _scheduler(a: Arch) -> Any:
    from diffusers import DDPMScheduler, EulerDiscreteScheduler, PNDMScheduler

    betas = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "steps_offset": 1}
    if a.text2 is not None:  # SDXL ships Euler with "leading" spacing
        scheduler = EulerDiscreteScheduler(**betas, prediction_type=a.prediction_type, timestep_spacing="leading")
    else:
        scheduler = PNDMScheduler(**betas, prediction_type=a.prediction_type, skip_prk_steps=True)
    # The training scheduler reads the same config; make sure it is a valid DDPM config too.
    DDPMScheduler.from_config(scheduler.config)
    return scheduler
