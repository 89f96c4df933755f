"""FLUX.2 [dev]'s training side (the family strategy :data:`TRAINING`): FLUX.2 [klein]'s
(:mod:`xeonsd.families.flux2.training`: the patchified, batch-normalised latents, the packed tokens and their
position ids, the reference image's tokens at time 10, σ on the scheduler's unshifted grid, the objective) with its
own text side, as diffusers' ``Flux2Pipeline`` encodes prompts and ``train_dreambooth_lora_flux2.py`` /
``train_dreambooth_lora_flux2_img2img.py`` (v0.39.0) train it:

* the text: each prompt as a conversation of FLUX.2's system message (``diffusers.pipelines.flux2.system_messages``)
  and one user turn (``format_input``), in the tokenizer's chat template without a generation prompt, padded and
  truncated to ``max_sequence_length`` (512), tokenized as ``PixtralProcessor.apply_chat_template`` does (no second
  ``<s>`` where the template gives one); through Mistral3 with its attention mask, the hidden states of layers 10,
  20 and 30 stacked and laid side by side per token ([L, 3 x 5120] in the real model:
  ``_get_mistral_3_small_prompt_embeds``). Mistral3 (24B) is frozen, every prompt is encoded once, then it is freed;
* the guidance embedding gets ``--guidance_scale`` (the scripts' default 3.5; FLUX.2 [dev] is guidance-distilled, and
  its pipeline runs no classifier-free guidance: the validation images get the prompt's embeddings alone);
* LoRA's default layers are the scripts' (``--lora_layers`` unset): the attention projections of every block, the
  single-stream blocks' fused projections in and out (48 of them in the real model).
"""

from __future__ import annotations

import torch

from xeonsd.families.flux2.training import Flux2Family, Flux2PromptConditioning
from xeonsd.families.flux2_dev import SPEC

HIDDEN_LAYERS = (10, 20, 30)  # Flux2Pipeline's text_encoder_out_layers
# train_dreambooth_lora_flux2(_img2img).py's default --lora_layers (None)
DEV_TARGETS = (
    "to_k",
    "to_q",
    "to_v",
    "to_out.0",
    "to_qkv_mlp_proj",
    *(f"single_transformer_blocks.{i}.attn.to_out" for i in range(48)),
)


class Flux2DevPromptConditioning(Flux2PromptConditioning):
    """The prompt table through Mistral3: klein's machinery (ids and mask as one [2, L] tensor per row, the stacked
    hidden states), with FLUX.2 [dev]'s conversation and layers."""

    hidden_layers = HIDDEN_LAYERS
    encoder = "Mistral3"

    def _tokenize(self, texts: list[str]) -> list[torch.Tensor]:
        """[ids and mask, [n, 2, L]] of the prompts in FLUX.2's conversation
        (Flux2Pipeline._get_mistral_3_small_prompt_embeds)."""
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

        tok = self.models.tokenizer
        chats = tok.apply_chat_template(format_input(texts, SYSTEM_MESSAGE), tokenize=False)
        # PixtralProcessor.apply_chat_template: no special tokens where the template already starts with <s>
        special = not (tok.bos_token is not None and chats[0].startswith(tok.bos_token))
        enc = tok(
            chats,
            padding="max_length",
            truncation=True,
            max_length=self.models.text_length,
            add_special_tokens=special,
            return_tensors="pt",
        )
        return [torch.stack([enc.input_ids, enc.attention_mask], dim=1)]

    def pipeline_kwargs(self, prompt: str) -> dict:
        """Flux2Pipeline's ``prompt_embeds`` (row 0, ``prompt``); it takes no negative prompt (guidance-distilled)."""
        assert self.prompts.texts[0] == prompt, "the sample conditioning holds another prompt"
        hidden, _ = self.encode([0])
        return {"prompt_embeds": hidden}


class Flux2DevFamily(Flux2Family):
    """FLUX.2 [dev]: klein's transformer, latents and objective, with a guidance embedding and Mistral3's text."""

    spec = SPEC
    conditioning = Flux2DevPromptConditioning
    lora_targets = DEV_TARGETS


TRAINING = Flux2DevFamily()
