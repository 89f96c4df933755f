"""Qwen-Image-Edit-2509/2511's training side (the family strategy :data:`TRAINING`): Qwen-Image's
(:mod:`xeonsd.families.qwenimage`), with the reference images as ``QwenImageEditPlusPipeline`` takes ``image=``:

* the text: the instruction in the edit pipeline's chat template, after one ``Picture k: <|vision_start|>
  <|image_pad|><|vision_end|>`` per reference image, through Qwen2.5-VL with each reference (resized to the
  pipeline's ~384x384 condition area, its aspect kept) in the vision tower; the last hidden states without the
  template's 64-token system prefix. A row of the prompt table is an image's (instruction, references), encoded
  once at start-up like Qwen-Image's prompts, so the table has a row per image
  (:meth:`~xeonsd.families.training.TrainFamily.with_references`); the caption draws that would need other rows
  (``--caption_dropout``, ``--shuffle_tags``) are refused for pairs;
* the references' latents (the latent cache's reference tables, normalised as the target's), packed 2x2, follow
  the noisy latents' tokens in the call, and ``img_shapes`` lists each image's (1, h/2, w/2) after the target's
  (the transformer places each on a frame of its own, and a ``zero_cond_t`` model, 2511, gives them timestep 0);
  the prediction of the noisy tokens alone is kept.

Our choice where the pipeline has none for training: a reference's latents are made at the training image's
``--resolution`` crop (as FLUX.2 [klein]'s and Kontext's), where the pipeline encodes a reference at ~1024x1024;
at ``--resolution 1024`` the two agree. The vision tower sees the whole reference image, as in the pipeline.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xeonsd.families.flow import pack, unpack
from xeonsd.families.qwenimage.training import QwenImageFamily, QwenPromptConditioning
from xeonsd.families.qwenimage_edit import SPEC
from xeonsd.trainer.config import ConfigError

# QwenImageEditPlusPipeline's prompt template, its system prefix's length and one reference's place in the prompt
# (prompt_template_encode(_start_idx), img_prompt_template: set in its __init__, so not readable without a pipeline)
TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
DROP_IDX = 64
PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"


class QwenEditPromptConditioning(QwenPromptConditioning):
    """Qwen-Image's prompt table (:class:`QwenPromptConditioning`) with each row's reference images in the vision
    tower: the token ids are [input ids, mask, each row's ``pixel_values`` and ``image_grid_thw``]."""

    template = TEMPLATE
    drop_idx = DROP_IDX

    def _tokenize(self, texts: list[str]) -> list:
        from diffusers.image_processor import VaeImageProcessor
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
            CONDITION_IMAGE_SIZE,
            calculate_dimensions,
        )
        from PIL import Image

        references = self.prompts.references
        if references is None or len(references) != len(texts):
            raise ConfigError(
                f"{self.models.family.label} reads the reference images with each prompt: this table "
                f"({self.prompts.source}) needs one row per image, with its references"
            )
        processor = self.models.processor
        resize = VaeImageProcessor(vae_scale_factor=16).resize
        ids, images = [], []
        for text, refs in zip(texts, references, strict=True):
            pictures = []
            for path in refs:
                with Image.open(path) as im:
                    im = im.convert("RGB")
                w, h = calculate_dimensions(CONDITION_IMAGE_SIZE, im.size[0] / im.size[1])  # the pipeline's sizing
                pictures.append(resize(im, h, w))
            prompt = self.template.format("".join(PICTURE.format(k + 1) for k in range(len(refs))) + text)
            out = processor(text=[prompt], images=pictures, padding=True, return_tensors="pt")
            ids.append(out.input_ids[0])
            images.append({"pixel_values": out.pixel_values, "image_grid_thw": out.image_grid_thw})
            if len(ids[-1]) - self.drop_idx > self.models.text_length:
                raise ConfigError(
                    f"{self.prompts.source}: {text!r} with its {len(refs)} reference image(s) is "
                    f"{len(ids[-1]) - self.drop_idx} tokens; {self.models.family.label} takes at most "
                    f"{self.models.text_length}"
                )
        pad = self.models.tokenizer.pad_token_id
        width = max(len(t) for t in ids)
        input_ids = torch.stack([F.pad(t, (0, width - len(t)), value=pad) for t in ids])
        mask = (torch.arange(width)[None] < torch.tensor([len(t) for t in ids])[:, None]).long()
        return [input_ids, mask, images]

    def _select(self, rows: list[int]) -> list:
        input_ids, mask, images = self.ids
        return [input_ids[rows], mask[rows], [images[r] for r in rows]]


class QwenImageEditFamily(QwenImageFamily):
    """Qwen-Image-Edit-2509/2511: Qwen-Image's objective, with the references in the text and as latent tokens."""

    spec = SPEC
    conditioning = QwenEditPromptConditioning
    text_reads_references = True

    def rendering(self, resolution: int):
        """The pipeline encodes a reference at ~1024x1024 (its module's ``VAE_IMAGE_SIZE``, read in each call); the
        run trained on references at ``resolution``: inside, the pipeline's reference has that area."""
        from unittest import mock

        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as module

        return mock.patch.object(module, "VAE_IMAGE_SIZE", resolution * resolution)

    def load_processor(self, src, subfolder, tokenizer, **kw):
        from xeonsd.families.qwenimage_edit.processor import VisionProcessor

        return VisionProcessor.from_pretrained(src, subfolder, tokenizer=tokenizer, **kw)

    def denoiser_kwargs(self, config, noisy, sigmas, hidden, pooled, added, flow):
        kwargs = super().denoiser_kwargs(config, noisy, sigmas, hidden, pooled, added, flow)
        b, _, h, w = noisy.shape
        shapes = [(1, h // 2, w // 2)]
        tokens = [kwargs["hidden_states"]]
        for reference in added.get("references", ()):
            rh, rw = reference.shape[-2:]
            tokens.append(pack(reference.to(noisy.dtype)))
            shapes.append((1, rh // 2, rw // 2))
        kwargs["hidden_states"] = torch.cat(tokens, dim=1)
        kwargs["img_shapes"] = [shapes] * b
        return kwargs

    def unpack(self, pred, shape):
        h, w = shape[-2], shape[-1]
        return unpack(pred[:, : (h // 2) * (w // 2)], h, w)


TRAINING = QwenImageEditFamily()
