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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xeonsd.assets.parts import CLIP_G, CLIP_L, TINY_CLIP, TINY_CLIP_G, Clip, clip_model, default_dtype, vae_of
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
    """Dimensions of a generated flow-matching pipeline (``family``: ``flux`` or ``sd3``)."""

    family: str
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

    @property
    def sample_px(self) -> int:
        """The default image side: the latent side times the VAE's scale (2 per downsampling block)."""
        return self.sample_size * 2 ** (len(self.vae_channels) - 1)

    def with_depth(self, depth: int) -> FlowArch:
        """FLUX.1's widths with ``depth`` double-stream blocks and twice as many single-stream ones (the real model's
        19 + 38), so that a per-block figure scales to the full depth by 19/depth."""
        check_depth(self.family, depth)
        return dataclasses.replace(self, layers=depth, single_layers=2 * depth)


# the archs whose --depth cuts the transformer's blocks (FLUX.1 here; the Qwen-encoder ones: open_models.py)
DEPTH_ARCHS = ("flux", "flux2-klein", "zimage", "qwenimage")


def check_depth(arch: str, depth: int | None, model: str | None = None) -> None:
    """Refuse a ``--depth`` that ``arch`` cannot take, or any with a ``--model`` (a built model's depth is its own):
    ValueError naming the problem; None: the arch's own depth. The one rule make-tiny-model, ``bench train`` and
    ``bench generate`` apply."""
    if depth is None:
        return
    if model or arch not in DEPTH_ARCHS:
        given = f"--model {model}" if model else f"--arch {arch}"
        raise ValueError(f"--depth applies to --arch {' or '.join(DEPTH_ARCHS)} only, not to {given}")
    if depth < 1:
        raise ValueError(f"--depth must be at least 1, got {depth}")


def model_name(arch: str, depth: int | None) -> str:
    """The name of an ``--arch`` model's directory in a benchmark's cache: ``flux-depth2`` for a cut one."""
    return arch if depth is None else f"{arch}-depth{depth}"


_T5_XXL = T5(d_model=4096, layers=24, heads=64, d_kv=64, d_ff=10240, vocab_size=32128)

FLOW_ARCHS: dict[str, FlowArch] = {
    # FLUX.1-dev: 19 double + 38 single blocks, 24 heads x 128 (3072 wide, 11.9 B parameters), guidance embedding.
    "flux": FlowArch(
        family="flux",
        layers=19,
        single_layers=38,
        heads=24,
        head_dim=128,
        guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
        clip_l=CLIP_L,
        t5=_T5_XXL,
        vae_channels=(128, 256, 512, 512),
        vae_layers=2,
        vae_scaling=0.3611,
        vae_shift=0.1159,
        norm_groups=32,
        sample_size=128,
        clip_vocab_size=49408,
        weights_dtype="bfloat16",
    ),
    # SD3.5 medium: 24 MMDiT blocks, 24 heads x 64, dual attention in the first 13, RMS q/k norm; CLIP-L, CLIP-G, T5-XXL.
    "sd35m": FlowArch(
        family="sd3",
        layers=24,
        heads=24,
        head_dim=64,
        clip_l=CLIP_L,
        clip_g=CLIP_G,
        t5=dataclasses.replace(_T5_XXL, max_length=256),
        dual_attention_layers=tuple(range(13)),
        qk_norm="rms_norm",
        pos_embed_max_size=384,
        vae_channels=(128, 256, 512, 512),
        vae_layers=2,
        vae_scaling=1.5305,
        vae_shift=0.0609,
        norm_groups=32,
        sample_size=128,
        clip_vocab_size=49408,
        weights_dtype="bfloat16",
    ),
    # The same structures at the tiny pipelines' size (64 px), for the tests.
    "tiny-flux": FlowArch(
        family="flux",
        layers=1,
        single_layers=1,
        heads=2,
        head_dim=16,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
        clip_l=TINY_CLIP,
        t5=T5(d_model=32, layers=2, heads=4, d_kv=8, d_ff=64, max_length=32),
        vae_channels=(8, 8, 16, 16),
        vae_layers=1,
        vae_scaling=0.3611,
        vae_shift=0.1159,
        norm_groups=8,
        sample_size=8,
    ),
    "tiny-sd3": FlowArch(
        family="sd3",
        layers=2,
        heads=2,
        head_dim=16,
        clip_l=TINY_CLIP,
        clip_g=TINY_CLIP_G,
        t5=T5(d_model=64, layers=2, heads=4, d_kv=16, d_ff=128, max_length=32),
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
        pos_embed_max_size=16,
        vae_channels=(8, 8, 16, 16),
        vae_layers=1,
        vae_scaling=1.5305,
        vae_shift=0.0609,
        norm_groups=8,
        sample_size=8,
    ),
}


def make_flow_model(out: Path, arch: str, seed: int = 0, depth: int | None = None) -> Path:
    """Write a random-weight ``FluxPipeline`` or ``StableDiffusion3Pipeline`` directory of ``arch`` to ``out``."""
    import torch
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    if arch not in FLOW_ARCHS:
        raise ValueError(f"unknown flow --arch {arch!r}; choose one of {sorted(FLOW_ARCHS)}")
    a = FLOW_ARCHS[arch]
    if depth is not None:
        a = a.with_depth(depth)
    out = Path(out)
    dtype = getattr(torch, a.weights_dtype)
    torch.manual_seed(seed)
    vocab, merges = build_clip_vocab(list(WORDS), a.clip_vocab_size)
    # Built in this order from one seed: the weights depend on it.
    with default_dtype(dtype):
        transformer = _flux_transformer(a) if a.family == "flux" else _sd3_transformer(a)
        vae = _vae(a)
        clip_l = clip_model(a.clip_l, vocab, projection=a.family == "sd3")
        clip_g = clip_model(a.clip_g, vocab, projection=True) if a.clip_g is not None else None
        t5_tokenizer = _t5_tokenizer(a.t5)
        t5 = _t5(a.t5, len(t5_tokenizer))
    tokenizer = clip_tokenizer(vocab, merges)
    parts = {
        "transformer": transformer,
        "scheduler": _scheduler(a),
        "vae": vae,
        "text_encoder": clip_l,
        "tokenizer": tokenizer,
    }
    if a.family == "flux":
        pipe = FluxPipeline(**parts, text_encoder_2=t5, tokenizer_2=t5_tokenizer)
    else:
        pipe = StableDiffusion3Pipeline(
            **parts, text_encoder_2=clip_g, tokenizer_2=tokenizer, text_encoder_3=t5, tokenizer_3=t5_tokenizer
        )
    with atomic_dir(out) as tmp:
        pipe.save_pretrained(tmp, safe_serialization=True)
    n = sum(p.numel() for p in transformer.parameters())
    log.info("wrote %s pipeline to %s (transformer %.1fM parameters)", arch, out, n / 1e6)
    return out


def _flux_transformer(a: FlowArch) -> Any:
    from diffusers import FluxTransformer2DModel

    assert sum(a.axes_dims_rope) == a.head_dim, "FLUX's rotary axes split the head dimension"
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * 16,  # 16 latent channels packed 2x2
        num_layers=a.layers,
        num_single_layers=a.single_layers,
        attention_head_dim=a.head_dim,
        num_attention_heads=a.heads,
        joint_attention_dim=a.t5.d_model,
        pooled_projection_dim=a.clip_l.hidden,
        guidance_embeds=a.guidance_embeds,
        axes_dims_rope=a.axes_dims_rope,
    )


def _sd3_transformer(a: FlowArch) -> Any:
    from diffusers import SD3Transformer2DModel

    assert a.clip_g is not None
    clip_width = a.clip_l.hidden + a.clip_g.hidden
    if a.t5.d_model < clip_width:
        raise ValueError("SD3's CLIP hidden states are padded to T5's width: T5 must be the wider")
    return SD3Transformer2DModel(
        sample_size=a.sample_size,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=a.layers,
        attention_head_dim=a.head_dim,
        num_attention_heads=a.heads,
        joint_attention_dim=a.t5.d_model,
        caption_projection_dim=a.heads * a.head_dim,
        pooled_projection_dim=clip_width,
        pos_embed_max_size=a.pos_embed_max_size,
        dual_attention_layers=a.dual_attention_layers,
        qk_norm=a.qk_norm,
    )


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


def _scheduler(a: FlowArch) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    if a.family == "flux":
        return FlowMatchEulerDiscreteScheduler(**FLUX_SHIFT)
    return FlowMatchEulerDiscreteScheduler(shift=3.0)
