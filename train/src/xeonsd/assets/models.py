"""The offline pipelines: ``make-tiny-model --arch`` finds the arch in a family folder's ``assets`` (its ``ARCHS``
and its ``make``) and builds it with random weights; the UNet families' :class:`Arch` and builder are here, the
flow families' in :mod:`.flow_models` and :mod:`.open_models`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xeonsd.assets.parts import Clip, clip_model, vae_of
from xeonsd.assets.vocab import WORDS, build_clip_vocab, clip_tokenizer
from xeonsd.fsutil import atomic_dir

if TYPE_CHECKING:
    from xeonsd.families import FamilySpec

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


def family_archs() -> dict[str, tuple[FamilySpec, Any]]:
    """Every ``make-tiny-model --arch``: its name -> (its family, its dimensions), from the ``ARCHS`` of each
    family folder's ``assets`` module, in the registry's order."""
    from xeonsd.families import REGISTRY

    return {name: (family, a) for family in REGISTRY for name, a in family.assets.ARCHS.items()}


def arch_names() -> list[str]:
    """Every ``make-tiny-model --arch`` (the tiny ones for the tests, the real widths for the benchmarks)."""
    return list(family_archs())


def arch_resolution(arch: str) -> int:
    """The default image side of an ``--arch`` model (its denoiser's sample size x the VAE's scale)."""
    return family_archs()[arch][1].sample_px


def depth_archs() -> list[str]:
    """The archs whose ``--depth`` cuts the denoiser's blocks (their dimensions' ``cuts_depth``)."""
    return [name for name, (_, a) in family_archs().items() if getattr(a, "cuts_depth", False)]


def check_depth(arch: str, depth: int | None, model: str | None = None) -> None:
    """Refuse a ``--depth`` that ``arch`` cannot take (its dimensions' ``cuts_depth``), or any with a ``--model`` (a
    built model's depth is its own): ValueError naming the problem; None: the arch's own depth. The one rule
    make-tiny-model, ``bench train`` and ``bench generate`` apply."""
    if depth is None:
        return
    cut = depth_archs()
    if model or arch not in cut:
        given = f"--model {model}" if model else f"--arch {arch}"
        raise ValueError(f"--depth applies to --arch {' or '.join(cut)} only, not to {given}")
    if depth < 1:
        raise ValueError(f"--depth must be at least 1, got {depth}")


def model_name(arch: str, depth: int | None) -> str:
    """The name of an ``--arch`` model's directory in a benchmark's cache: ``flux-depth2`` for a cut one."""
    return arch if depth is None else f"{arch}-depth{depth}"


def make_tiny_model(
    out: Path, arch: str = "tiny", seed: int = 0, depth: int | None = None, configs_only: bool = False
) -> Path:
    """Write a random-weight pipeline directory of the given architecture to ``out``, built by the family the arch
    belongs to (its folder's ``assets.make``): ``depth`` cuts the denoiser's blocks where the arch allows it
    (:func:`check_depth`); ``configs_only``: the configs without weights, where the family can (the Qwen-encoder
    ones, for the estimate of a model this machine cannot hold)."""
    archs = family_archs()
    if arch not in archs:
        raise ValueError(f"unknown --arch {arch!r}; choose one of {list(archs)}")
    check_depth(arch, depth)
    family, a = archs[arch]
    if configs_only and not getattr(family.assets, "CONFIGS_ONLY", False):
        only = [name for name, (f, _) in archs.items() if getattr(f.assets, "CONFIGS_ONLY", False)]
        raise ValueError(f"--configs-only is for {', '.join(sorted(only))}, not --arch {arch}")
    return family.assets.make(Path(out), arch, a, seed=seed, depth=depth, configs_only=configs_only)


def make_unet_model(out: Path, arch: str, a: Arch, seed: int = 0) -> Path:
    """A ``StableDiffusionPipeline``, or a ``StableDiffusionXLPipeline`` where ``a`` has a second text encoder."""
    import torch
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

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
