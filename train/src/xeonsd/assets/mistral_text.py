"""The Mistral text side of the offline FLUX.2 [dev] pipelines (``families/flux2_dev/assets.py``).

* :func:`mistral_tokenizer`: a Tekken-style tokenizer (byte-level BPE, ``<s>`` prepended) whose merges are trained
  here on the tiny word list and FLUX.2's system message (``diffusers.pipelines.flux2.system_messages``), so that
  every word of them is one token, as in the real vocabulary. It has Mistral's control tokens at their ids
  (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, ``[INST]`` 3, ``[IMG]`` 10, ``<pad>`` 11, ``[SYSTEM_PROMPT]`` 17, …) and a
  chat template that renders a conversation as Mistral Small 3.x's does (``<s>[SYSTEM_PROMPT]…[/SYSTEM_PROMPT]
  [INST]…[/INST]``), for messages whose content is a string or a list of text and image blocks: what
  ``Flux2Pipeline`` formats.
* no ``PixtralProcessor`` beside it: the released model's ``model_index.json`` names one (``AutoProcessor``), which
  transformers 5.5 builds only with torchvision, and this project does not install torchvision. ``Flux2Pipeline``
  calls ``tokenizer.apply_chat_template`` only (its prompt upsampling, which we do not run, needs the processor), so
  the tiny pipelines hold the tokenizer itself, and their ``model_index.json`` names its class.
* :func:`mistral3_encoder`: a random-weight ``Mistral3ForConditionalGeneration`` (a Mistral language model and a
  Pixtral vision tower) of a :class:`MistralText` size; its embedding has the real model's row count where one is
  given (131,072).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from xeonsd.assets.vocab import WORDS

# Tekken's control tokens, ids 0-19 in this order (Mistral Small 3.x / Pixtral).
CONTROL = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
)
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
IMAGE_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")

# Mistral Small 3.x's chat template for plain conversations: a system turn (its own, or none), user turns whose
# content is a string or a list of text and image blocks (an image is one [IMG], which the processor expands),
# assistant turns closed by </s>.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}"
    "{%- if system is not string %}{%- set system = system | map(attribute='text') | join('') %}{%- endif %}"
    "{{- '[SYSTEM_PROMPT]' + system + '[/SYSTEM_PROMPT]' }}"
    "{%- set messages = messages[1:] %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}"
    "{{- '[INST]' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for block in message['content'] %}"
    "{%- if block['type'] == 'text' %}{{- block['text'] }}"
    "{%- elif block['type'] in ('image', 'image_url') %}{{- '[IMG]' }}"
    "{%- else %}{{- raise_exception('Only text and image blocks are supported in message content') }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{{- message['content'] | map(attribute='text') | join('') }}{%- endif %}"
    "{{- eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
)


@dataclass(frozen=True)
class PixtralVision:
    """Pixtral's vision tower (Mistral3's image encoder, merged patches projected into the text width)."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    patch_size: int
    image_size: int


@dataclass(frozen=True)
class MistralText:
    """A Mistral3 text encoder's sizes: the language model's and its ``vision`` tower's."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    head_dim: int
    vision: PixtralVision
    vocab_size: int | None = None  # None: the tokenizer's size; Mistral Small 3.x has 131,072 rows
    rope_theta: float = 1_000_000_000.0
    max_positions: int = 131072
    spatial_merge_size: int = 2


def _corpus() -> list[str]:
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    words = " ".join(WORDS)
    return [words, SYSTEM_MESSAGE, *WORDS, *(f" {w}" for w in WORDS), *SYSTEM_MESSAGE.split()]


def _backend() -> Any:
    """The ``tokenizers`` model: byte-level BPE trained to completion on :func:`_corpus`, the control tokens first
    (ids 0-19), ``<s>`` prepended to each text."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=20000,
        min_frequency=1,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in CONTROL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    assert [tok.token_to_id(t) for t in CONTROL] == list(range(len(CONTROL))), "the control tokens' ids moved"
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 1)])
    return tok


def mistral_tokenizer(max_length: int = 131072) -> Any:
    """The tiny Tekken-style tokenizer (see the module docstring), with the chat template."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=_backend(),
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        model_max_length=max_length,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def mistral3_encoder(t: MistralText, tokenizer: Any) -> Any:
    """A random-weight ``Mistral3ForConditionalGeneration`` (the class FLUX.2 [dev] loads) of ``t``'s size."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    v = t.vision
    ids = tokenizer.convert_tokens_to_ids
    text = {
        "model_type": "mistral",
        "vocab_size": t.vocab_size or len(tokenizer),
        "hidden_size": t.hidden,
        "intermediate_size": t.intermediate,
        "num_hidden_layers": t.layers,
        "num_attention_heads": t.heads,
        "num_key_value_heads": t.kv_heads,
        "head_dim": t.head_dim,
        "max_position_embeddings": t.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": t.rope_theta},
        "sliding_window": None,
        "bos_token_id": ids(BOS),
        "eos_token_id": ids(EOS),
        "pad_token_id": ids(PAD),
    }
    vision = {
        "model_type": "pixtral",
        "hidden_size": v.hidden,
        "intermediate_size": v.intermediate,
        "num_hidden_layers": v.layers,
        "num_attention_heads": v.heads,
        "head_dim": v.hidden // v.heads,
        "patch_size": v.patch_size,
        "image_size": v.image_size,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    config = Mistral3Config(
        text_config=text,
        vision_config=vision,
        image_token_index=ids(IMAGE_TOKENS[0]),
        spatial_merge_size=t.spatial_merge_size,
        multimodal_projector_bias=False,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    return Mistral3ForConditionalGeneration(config).eval()
