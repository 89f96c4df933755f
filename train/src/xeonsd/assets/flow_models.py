"""The offline flow-matching pipelines: FLUX.1 (``FluxPipeline``) and SD3/SD3.5 (``StableDiffusion3Pipeline``),
one :class:`FlowArch` per ``make-tiny-model --arch``, built with random weights.

What makes them this family, as in the released models:

* a transformer denoiser (``FluxTransformer2DModel``: double-stream then single-stream blocks, latents packed 2x2
  into tokens with 3-axis rotary positions; ``SD3Transformer2DModel``: MMDiT blocks over 2x2 patches);
* a 16-channel VAE with a scaling *and* a shift factor, and no quant convs;
* CLIP text encoders (FLUX: CLIP-L's pooled output; SD3: CLIP-L and CLIP-G, both pooled and hidden) beside a T5
  encoder whose hidden states are the long context;
* ``FlowMatchEulerDiscreteScheduler`` with the model's shift (FLUX: resolution-dependent, ``use_dynamic_shifting``).

The T5 tokenizer is a SentencePiece-style Unigram model (``▁`` word boundaries, ``</s>`` appended, ``<pad>`` 0)
written as a ``tokenizer.json``, over the same word list as the tiny CLIP vocabulary.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xeonsd.assets.parts import Clip, clip_model, default_dtype, vae_of
from xeonsd.assets.vocab import WORDS, build_clip_vocab, clip_tokenizer
from xeonsd.fsutil import atomic_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class T5:
    d_model: int
    layers: int
    heads: int
    d_kv: int
    d_ff: int
    vocab_size: int | None = None  # None: the tiny word list; the real T5-XXL has 32,128 entries
    max_length: int = 512  # the pipeline's max_sequence_length (FLUX.1-dev 512, schnell 256, SD3 256)


@dataclass(frozen=True)
class FlowArch:
    """Dimensions of a generated flow-matching pipeline (FLUX.1: ``single_layers``, ``guidance_embeds``; SD3:
    ``clip_g``); ``cuts_depth``: ``--depth`` may cut its transformer's blocks."""

    layers: int  # FLUX: double-stream blocks; SD3: joint blocks
    heads: int
    head_dim: int
    clip_l: Clip
    t5: T5
    vae_channels: tuple[int, ...]
    vae_layers: int
    vae_scaling: float
    vae_shift: float
    norm_groups: int
    sample_size: int  # latent side at the default resolution
    clip_vocab_size: int | None = None
    # FLUX
    single_layers: int = 0
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, int, int] = (0, 0, 0)
    # SD3
    clip_g: Clip | None = None
    dual_attention_layers: tuple[int, ...] = ()
    qk_norm: str | None = None
    pos_embed_max_size: int = 96
    weights_dtype: str = "float32"  # the big benchmark archs are written in bf16 (their fp32 T5 alone is 19 GB)
    cuts_depth: bool = False

    @property
    def sample_px(self) -> int:
        """The default image side: the latent side times the VAE's scale (2 per downsampling block)."""
        return self.sample_size * 2 ** (len(self.vae_channels) - 1)

    def with_depth(self, depth: int) -> FlowArch:
        """The widths of ``self`` with ``depth`` blocks and single-stream ones in the same proportion (FLUX.1's
        19 + 38: twice as many), so that a per-block figure scales to the full depth by layers/depth."""
        return dataclasses.replace(self, layers=depth, single_layers=depth * self.single_layers // self.layers)


T5_XXL = T5(d_model=4096, layers=24, heads=64, d_kv=64, d_ff=10240, vocab_size=32128)


def make_flow_model(
    out: Path,
    arch: str,
    a: FlowArch,
    transformer: Callable[[FlowArch], Any],
    scheduler: Callable[[FlowArch], Any],
    pipeline: Callable[..., Any],
    seed: int = 0,
    depth: int | None = None,
) -> Path:
    """Write a random-weight pipeline of ``a`` to ``out``: the CLIP and T5 text side and the VAE built here, the
    family's ``transformer(a)``, ``scheduler(a)`` and ``pipeline(**parts)`` (its folder's ``assets``)."""
    import torch

    if depth is not None:
        a = a.with_depth(depth)
    out = Path(out)
    dtype = getattr(torch, a.weights_dtype)
    torch.manual_seed(seed)
    vocab, merges = build_clip_vocab(list(WORDS), a.clip_vocab_size)
    # Built in this order from one seed: the weights depend on it.
    with default_dtype(dtype):
        denoiser = transformer(a)
        vae = _vae(a)
        clip_l = clip_model(a.clip_l, vocab, projection=a.clip_g is not None)  # SD3's CLIP-L is pooled too
        clip_g = clip_model(a.clip_g, vocab, projection=True) if a.clip_g is not None else None
        t5_tokenizer = _t5_tokenizer(a.t5)
        t5 = _t5(a.t5, len(t5_tokenizer))
    tokenizer = clip_tokenizer(vocab, merges)
    pipe = pipeline(
        transformer=denoiser,
        scheduler=scheduler(a),
        vae=vae,
        clip_l=clip_l,
        clip_g=clip_g,
        tokenizer=tokenizer,
        t5=t5,
        t5_tokenizer=t5_tokenizer,
    )
    with atomic_dir(out) as tmp:
        pipe.save_pretrained(tmp, safe_serialization=True)
    n = sum(p.numel() for p in denoiser.parameters())
    log.info("wrote %s pipeline to %s (transformer %.1fM parameters)", arch, out, n / 1e6)
    return out


def _vae(a: FlowArch) -> Any:
    return vae_of(a.vae_channels, a.vae_layers, a.norm_groups, a.sample_px, a.vae_scaling, shift=a.vae_shift)


PAD, T5_EOS, UNK = "<pad>", "</s>", "<unk>"
# FLUX.1's scheduler config: the shift grows with the image's token count (FLUX.2-klein's has the same figures)
FLUX_SHIFT = {
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}


def _t5_tokenizer(t: T5) -> Any:
    """A T5-style tokenizer: Unigram pieces (special tokens, every tiny word as one ``▁word`` piece, then single
    characters so that any text tokenizes), ``</s>`` appended, padded with ``<pad>`` (id 0), as T5's own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5Tokenizer

    chars = sorted({ch for w in WORDS for ch in w} | set("abcdefghijklmnopqrstuvwxyz0123456789,.-'!?"))
    pieces: list[tuple[str, float]] = [(PAD, 0.0), (T5_EOS, 0.0), (UNK, 0.0)]
    pieces += [(f"▁{w}", -1.0) for w in WORDS]
    pieces += [("▁", -5.0)] + [(ch, -10.0) for ch in chars if f"▁{ch}" != ch]
    if t.vocab_size is not None:
        pieces += [(f"<filler{i}>", -100.0) for i in range(t.vocab_size - len(pieces))]
    model = models.Unigram(pieces, unk_id=2, byte_fallback=False)
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single=f"$A {T5_EOS}", special_tokens=[(T5_EOS, 1)])
    return T5Tokenizer(
        tokenizer_object=tok,
        eos_token=T5_EOS,
        unk_token=UNK,
        pad_token=PAD,
        extra_ids=0,
        model_max_length=t.max_length,
    )


def _t5(t: T5, vocab_size: int) -> Any:
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab_size,
        d_model=t.d_model,
        d_kv=t.d_kv,
        d_ff=t.d_ff,
        num_layers=t.layers,
        num_heads=t.heads,
        relative_attention_num_buckets=32,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5EncoderModel(config)
