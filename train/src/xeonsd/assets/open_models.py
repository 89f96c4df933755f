"""The offline pipelines of the open-weight families with Qwen text encoders: FLUX.2-klein (``Flux2KleinPipeline``),
Z-Image (``ZImagePipeline``) and Qwen-Image (``QwenImagePipeline``), one :class:`OpenArch` per
``make-tiny-model --arch``, built with random weights; FLUX.2 [dev] (``Flux2Pipeline``: ``tiny-flux2-dev`` /
``flux2-dev``) is built here too, with its Mistral text side (:mod:`.mistral_text`, ``OpenParts.tokenizer``).

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
* ``tiny-krea2`` / ``krea2`` (:mod:`xeonsd.families.krea2.assets`): Krea 2 (12B single-stream DiT) on Qwen-Image's
  VAE, with a ``Qwen3VLModel`` (vision tower included) whose tapped layers' hidden states are the context.

The tiny archs make 64 px images in a few seconds on two cores (latent 8x8, 16 image tokens) and take a few MB.
The full archs have the released widths in bf16; ``--depth D`` cuts the denoiser's blocks (FLUX.2-klein: D
double-stream and 4D single-stream, as the real 5 + 20; Z-Image: D main layers, the 2 + 2 refiners kept;
Qwen-Image: D of 60), since the full ones do not fit 24 GB. Their text encoders are the real size (Qwen3-4B: 8 GB
in bf16; Qwen2.5-VL-7B: 16.6 GB), the cut only applies to the denoiser; but FLUX.2 [dev]'s 24 B Mistral (48 GB) fits
no test machine, so its cut builds take ``OpenArch.depth_text``: the real output width and tapped layers, thinner
inside.
Tokenizers and encoders: :mod:`.open_text`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xeonsd.assets.mistral_text import MistralText
from xeonsd.assets.open_text import QwenText, QwenVision, qwen_tokenizer
from xeonsd.assets.parts import default_dtype
from xeonsd.fsutil import atomic_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpenArch:
    """Dimensions of a generated Qwen-encoder pipeline (FLUX.2: ``single_layers``; Z-Image: ``refiner_layers``,
    ``axes_lens``); ``cuts_depth``: ``--depth`` may cut its denoiser's blocks."""

    layers: int  # FLUX.2: double-stream blocks; Z-Image: main layers; Qwen-Image: MMDiT blocks
    heads: int
    head_dim: int
    axes_dims_rope: tuple[int, ...]
    text: QwenText | MistralText  # FLUX.2 [dev]: a Mistral3 (:mod:`.mistral_text`)
    vae_channels: tuple[int, ...]  # Qwen-Image: base_dim * dim_mult
    vae_layers: int
    norm_groups: int = 32
    single_layers: int = 0  # FLUX.2
    refiner_layers: int = 0  # Z-Image
    axes_lens: tuple[int, ...] = ()  # Z-Image
    sample_px: int = 1024  # the VAE's sample_size: the default image side
    weights_dtype: str = "float32"
    cuts_depth: bool = False
    # the text encoder a ``--depth`` build takes instead of ``text``, where the real one fits no test machine
    # (FLUX.2 [dev]'s 24 B Mistral): the real output width and tapped layers, so the denoiser sees the real context
    depth_text: QwenText | MistralText | None = None

    def with_depth(self, depth: int) -> OpenArch:
        """The widths of ``self`` with ``depth`` denoiser blocks and single-stream ones in the same proportion
        (FLUX.2-klein's 5 + 20: 4x as many), and ``depth_text`` where it has one; ``depth`` as
        :func:`xeonsd.assets.models.check_depth` allows it."""
        return dataclasses.replace(
            self,
            layers=depth,
            single_layers=depth * self.single_layers // self.layers,
            text=self.depth_text or self.text,
        )


QWEN3_4B = QwenText(
    hidden=2560,
    layers=36,
    heads=32,
    kv_heads=8,
    intermediate=9728,
    head_dim=128,
    vocab_size=151936,
    tie_embeddings=True,
)
QWEN25_VL_7B = QwenText(
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
TINY_VISION = QwenVision(depth=2, hidden=16, intermediate=32, heads=2, fullatt_blocks=(1,))


@dataclass(frozen=True)
class OpenParts:
    """What a Qwen-encoder family builds of its pipeline (its folder's ``assets``): the denoiser, the VAE and the
    scheduler of an :class:`OpenArch`, its text encoder from the tokenizer, and the pipeline of them; ``tokenizer``:
    Qwen's, unless the family's text side is another (FLUX.2 [dev]'s Mistral: :mod:`.mistral_text`)."""

    transformer: Callable[[OpenArch], Any]
    vae: Callable[[OpenArch], Any]
    scheduler: Callable[[OpenArch], Any]
    text_encoder: Callable[[Any, Any], Any]
    pipeline: Callable[..., Any]
    # what the pipeline directory holds besides what save_pretrained writes: ``finish(directory, tokenizer)``
    # (Qwen-Image-Edit's processor/ folder)
    finish: Callable[[Path, Any], None] | None = None
    tokenizer: Callable[[], Any] = qwen_tokenizer


def make_open_model(
    out: Path,
    arch: str,
    a: OpenArch,
    parts: OpenParts,
    seed: int = 0,
    depth: int | None = None,
    configs_only: bool = False,
) -> Path:
    """Write a random-weight pipeline of ``a`` to ``out``, its parts built by the family (``parts``: its folder's
    ``assets``), the Qwen tokenizer here unless the family builds its own (``parts.tokenizer``).
    ``configs_only``: the same directory without weights (the models built on the meta device, their configs, the
    tokenizer and model_index.json written): what ``xeonsd train --dry_run`` and doctor's memory row read, for the
    architectures this machine cannot hold (Qwen-Image: 20 B + 8 B parameters)."""
    import contextlib

    import torch
    from accelerate import init_empty_weights

    if depth is not None:
        a = a.with_depth(depth)
    out = Path(out)
    torch.manual_seed(seed)
    tokenizer = parts.tokenizer()
    # Built in this order from one seed: the weights depend on it.
    empty = init_empty_weights() if configs_only else contextlib.nullcontext()
    with default_dtype(getattr(torch, a.weights_dtype)), empty:
        transformer = parts.transformer(a)
        vae = parts.vae(a)
        text_encoder = parts.text_encoder(a.text, tokenizer)
    pipe = parts.pipeline(
        scheduler=parts.scheduler(a), transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer
    )
    with atomic_dir(out) as tmp:
        if configs_only:
            _save_configs(pipe, tmp)
        else:
            pipe.save_pretrained(tmp, safe_serialization=True)
        if parts.finish is not None:
            parts.finish(Path(tmp), tokenizer)
    n = sum(p.numel() for p in transformer.parameters())
    what = "configs" if configs_only else "pipeline"
    log.info("wrote %s %s to %s (transformer %.1fM parameters)", arch, what, out, n / 1e6)
    return out


def _save_configs(pipe: Any, out: Path) -> None:
    """A pipeline directory without weights: model_index.json, each component's config, the tokenizer."""
    pipe.save_config(out)  # model_index.json
    for name, part in pipe.components.items():
        if part is None:  # a component the family writes itself (OpenParts.finish)
            continue
        if hasattr(part, "save_config"):  # diffusers models and schedulers
            part.save_config(out / name)
        elif hasattr(part, "save_pretrained") and not hasattr(part, "parameters"):  # tokenizers
            part.save_pretrained(out / name)
        else:  # transformers models: the config (and its generation config, where it has one)
            part.config.save_pretrained(out / name)
            if getattr(part, "generation_config", None) is not None:
                part.generation_config.save_pretrained(out / name)
