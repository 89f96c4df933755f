"""Qwen2.5-VL's processor for the edit pipeline's prompts, without torchvision: the pipeline's own
``Qwen2VLProcessor`` loads a video processor that needs torchvision, whose PyPI wheels do not import beside our CPU
torch (requirements.txt). Images go through Qwen2.5-VL's image processor (its PIL backend); each
``<|image_pad|>`` of the text becomes one token per merged patch of its image, as ``Qwen2VLProcessor`` expands it.
:class:`VisionProcessor` is called as the pipeline calls its ``processor``, so it is what we hand
``QwenImageEditPlusPipeline`` (``processor=``) too. :func:`write_processor` writes a pipeline's ``processor/`` folder
as the released models ship it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

IMAGE_PAD = "<|image_pad|>"


def _processor_base() -> type:
    from transformers import ProcessorMixin

    return ProcessorMixin


class VisionProcessor(_processor_base()):
    """``processor(text=[...], images=[...], padding=True, return_tensors="pt")``: the token ids and attention mask
    of the texts with each ``<|image_pad|>`` expanded, and the images' ``pixel_values`` and ``image_grid_thw``.
    A ``ProcessorMixin`` for diffusers' component check only: none of its machinery is used (its ``__init__``
    would ask for the video processor)."""

    def __init__(self, image_processor: Any, tokenizer: Any) -> None:  # noqa: D107 - no ProcessorMixin.__init__
        self.image_processor, self.tokenizer = image_processor, tokenizer
        self.chat_template = None

    def __repr__(self) -> str:
        return f"VisionProcessor({type(self.image_processor).__name__}, {type(self.tokenizer).__name__})"

    @classmethod
    def from_pretrained(cls, src: str | Path, subfolder: str = "processor", tokenizer: Any = None, **kw: Any):
        """The pipeline's ``processor/`` (its image processor's config; the tokenizer there unless given)."""
        from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

        images = Qwen2VLImageProcessorPil.from_pretrained(src, subfolder=subfolder, **kw)
        return cls(images, tokenizer or AutoTokenizer.from_pretrained(src, subfolder=subfolder, **kw))

    def __call__(self, text=None, images=None, padding: bool = True, return_tensors: str = "pt", **_: Any):
        from transformers import BatchFeature

        texts = [text] if isinstance(text, str) else list(text)
        out: dict[str, Any] = {}
        if images:
            seen = self.image_processor(images=images, return_tensors="pt")
            out.update(pixel_values=seen["pixel_values"], image_grid_thw=seen["image_grid_thw"])
            merge = self.image_processor.merge_size**2
            counts = iter(int(g.prod()) // merge for g in seen["image_grid_thw"])
            expanded = []
            for t in texts:
                parts = t.split(IMAGE_PAD)
                expanded.append(parts[0] + "".join(IMAGE_PAD * next(counts) + p for p in parts[1:]))
            texts = expanded
        tokens = self.tokenizer(texts, padding=padding, return_tensors=return_tensors)
        return BatchFeature({**out, "input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask})


def write_processor(out: Path, tokenizer: Any) -> None:
    """``out``: a ``processor/`` folder as Qwen-Image-Edit ships it (the tokenizer, Qwen2.5-VL's image processor
    config, ``processor_config.json`` naming ``Qwen2VLProcessor``)."""
    from transformers import Qwen2VLImageProcessorPil

    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2).save_pretrained(out)
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}, indent=2) + "\n")
