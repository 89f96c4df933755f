"""The Qwen text side of the offline FLUX.2-klein, Z-Image and Qwen-Image pipelines (:mod:`.open_models`).

* :func:`qwen_tokenizer`: a ``Qwen2Tokenizer`` (byte-level BPE, Qwen's pre-tokenizer regex, NFC) whose merges are
  trained here on the tiny word list and the Qwen-Image prompt template, so that every word is one token, as in
  the real vocabulary: the template's system prefix is then exactly ``prompt_template_encode_start_idx`` (34)
  tokens long, which the pipeline drops. It has Qwen's special tokens (``<|im_start|>``, ``<|im_end|>``,
  ``<|endoftext|>`` as padding, the vision markers) and a chat template that renders a plain conversation as
  Qwen3's does, ``enable_thinking`` included (FLUX.2-klein asks for ``False``, Z-Image for ``True``).
* :func:`qwen3_encoder` (``Qwen3ForCausalLM``), :func:`qwen25vl_encoder` (``Qwen2_5_VLForConditionalGeneration``,
  with its vision tower) and :func:`qwen3vl_encoder` (``Qwen3VLModel``, Krea 2's, with its vision tower):
  random-weight encoders of a :class:`QwenText` size. Their embedding has the real model's
  row count where one is given (151,936 / 152,064, more than the tokenizer fills, as in the released models).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from xeonsd.assets.vocab import WORDS

# Qwen-Image's prompt template (QwenImagePipeline.prompt_template_encode): its words go into the BPE corpus.
QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
THINK_TOKENS = ("<think>", "</think>")  # Qwen3's, added but not special (they stay in decoded text)

# Qwen3's chat template, for a conversation of plain messages (no tools, no images).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@dataclass(frozen=True)
class QwenVision:
    """Qwen2.5-VL's vision tower (a windowed-attention ViT whose merged patches land in the text width)."""

    depth: int
    hidden: int
    intermediate: int
    heads: int
    fullatt_blocks: tuple[int, ...]


@dataclass(frozen=True)
class Qwen3VLVision:
    """Qwen3-VL's vision tower (a ViT whose merged patches land in the text width, some of its layers' features
    added to the first text layers: ``deepstack``)."""

    depth: int
    hidden: int
    intermediate: int
    heads: int
    deepstack: tuple[int, ...]
    position_embeddings: int = 2304


@dataclass(frozen=True)
class QwenText:
    """A Qwen3 or Qwen2.5-VL language model's sizes; ``vision``: Qwen2.5-VL's tower (None: a Qwen3)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    head_dim: int | None = None  # None: hidden / heads (Qwen2.5); Qwen3 sets it
    vocab_size: int | None = None  # None: the tokenizer's size; the real models have 151,936 / 152,064 rows
    rope_theta: float = 1_000_000.0
    max_positions: int = 40960
    mrope_section: tuple[int, int, int] = (0, 0, 0)  # Qwen2.5-VL's (t, h, w) split of half the head dimension
    vision: QwenVision | Qwen3VLVision | None = None
    tie_embeddings: bool = False


def _corpus() -> list[str]:
    words = " ".join(WORDS)
    template = QWEN_IMAGE_TEMPLATE.replace("{}", words)
    for tok in (IM_START, IM_END):
        template = template.replace(tok, " ")
    return [words, template, "system user assistant", *WORDS, *(f" {w}" for w in WORDS), "\n\n"]


def _trained_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE merges trained to completion on :func:`_corpus`: each word of it (with or without its
    leading space) ends as one token, whatever order the merges come in."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=20000, min_frequency=1, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return dict(model["vocab"]), merges  # type: ignore[return-value]


def qwen_tokenizer(max_length: int = 32768) -> Any:
    """The tiny Qwen tokenizer (see the module docstring); the same for Qwen3 and Qwen2.5-VL encoders."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = _trained_bpe()
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token=IM_END,
        pad_token=PAD,
        model_max_length=max_length,
        errors="replace",
    )
    special = [PAD, IM_START, IM_END, *VISION_TOKENS]
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True) for t in special]})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _text_config(t: QwenText, tokenizer: Any) -> dict[str, Any]:
    """The language model's config entries that Qwen3 and Qwen2.5-VL share."""
    ids = tokenizer.convert_tokens_to_ids
    return {
        "vocab_size": t.vocab_size or len(tokenizer),
        "hidden_size": t.hidden,
        "intermediate_size": t.intermediate,
        "num_hidden_layers": t.layers,
        "num_attention_heads": t.heads,
        "num_key_value_heads": t.kv_heads,
        "max_position_embeddings": t.max_positions,
        "rms_norm_eps": 1e-6,
        "bos_token_id": ids(PAD),
        "eos_token_id": ids(IM_END),
        "pad_token_id": ids(PAD),
    }


def qwen3_encoder(t: QwenText, tokenizer: Any) -> Any:
    """A random-weight ``Qwen3ForCausalLM`` (the class FLUX.2-klein and Z-Image load) of ``t``'s size."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **_text_config(t, tokenizer),
        head_dim=t.head_dim or t.hidden // t.heads,
        rope_parameters={"rope_type": "default", "rope_theta": t.rope_theta},
        tie_word_embeddings=t.tie_embeddings,
    )
    return Qwen3ForCausalLM(config).eval()


def qwen25vl_encoder(t: QwenText, tokenizer: Any) -> Any:
    """A random-weight ``Qwen2_5_VLForConditionalGeneration`` (Qwen-Image's encoder), vision tower included."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    v = t.vision
    assert v is not None, "Qwen2.5-VL has a vision tower"
    head_dim = t.head_dim or t.hidden // t.heads
    assert sum(t.mrope_section) * 2 == head_dim, "M-RoPE's sections split half the head dimension"
    ids = tokenizer.convert_tokens_to_ids
    text = {
        **_text_config(t, tokenizer),
        "max_window_layers": t.layers,
        "rope_parameters": {"rope_type": "default", "rope_theta": t.rope_theta, "mrope_section": list(t.mrope_section)},
    }
    vision = {
        "depth": v.depth,
        "hidden_size": v.hidden,
        "intermediate_size": v.intermediate,
        "num_heads": v.heads,
        "out_hidden_size": t.hidden,
        "fullatt_block_indexes": list(v.fullatt_blocks),
        "tokens_per_second": 2,
    }
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=t.tie_embeddings,
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def qwen3vl_encoder(t: QwenText, tokenizer: Any) -> Any:
    """A random-weight ``Qwen3VLModel`` (Krea 2's encoder: the model without the LM head), vision tower included."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    v = t.vision
    assert isinstance(v, Qwen3VLVision), "Qwen3-VL has its own vision tower"
    head_dim = t.head_dim or t.hidden // t.heads
    assert sum(t.mrope_section) * 2 == head_dim, "M-RoPE's sections split half the head dimension"
    ids = tokenizer.convert_tokens_to_ids
    rope = {"rope_type": "default", "rope_theta": t.rope_theta, "mrope_section": list(t.mrope_section)}
    text = {**_text_config(t, tokenizer), "head_dim": head_dim, "rope_parameters": {**rope, "mrope_interleaved": True}}
    vision = {
        "depth": v.depth,
        "hidden_size": v.hidden,
        "intermediate_size": v.intermediate,
        "num_heads": v.heads,
        "out_hidden_size": t.hidden,
        "deepstack_visual_indexes": list(v.deepstack),
        "num_position_embeddings": v.position_embeddings,
    }
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=t.tie_embeddings,
    )
    return Qwen3VLModel(config).eval()
