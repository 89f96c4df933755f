"""Qwen-Image: what its pipeline is (:data:`SPEC`, detected from its config files) and, in :mod:`.training`, how it
trains. Qwen-Image (20B): Qwen2.5-VL's hidden states (the chat template's system prefix dropped), an MMDiT with separate image and text MLPs, the Wan-style 16-channel VAE (AutoencoderKLQwenImage)."""

from __future__ import annotations

from xeonsd.families.spec import FamilySpec

SPEC = FamilySpec(
    "qwenimage",
    "Qwen-Image",
    "QwenImagePipeline",
    "OVQwenImagePipeline",
    ("text_encoder",),
    ("tokenizer",),
    denoiser="transformer",
    denoiser_class="QwenImageTransformer2DModel",
    encoder_classes=("Qwen2_5_VLForConditionalGeneration",),
    vae_class="AutoencoderKLQwenImage",
    objective="flow",
    latent_multiple=2,
    max_sequence_length=512,
    kohya=None,
    lora_marks=(
        (
            r"^lora_transformer_transformer_blocks_\d+_(img_mlp|txt_mlp|img_mod|txt_mod)_",
            "it adapts Qwen-Image's image and text MLPs",
        ),
        # diffusers' default targets (attention only) share FLUX.1's, FLUX.2's and SD3's joint-block names:
        # only a block past SD3.5 Large's 38 (Qwen-Image has 60) tells them apart
        (
            r"^lora_transformer_transformer_blocks_(3[89]|[4-9]\d)_",
            "it adapts joint blocks past the 38 of the other MMDiTs (Qwen-Image has 60)",
        ),
    ),
    genai_edits=("image2image",),
    guidance_scale=4.0,
    negative_prompt_cfg=False,
    resolution_shift=False,
    pipeline_aliases=("QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline"),
    variants=(
        ("QwenImageEditPipeline", "Qwen-Image-Edit, an edit model that takes a reference image"),
        ("QwenImageEditInpaintPipeline", "Qwen-Image-Edit's inpainting, an edit model that takes a reference image"),
        ("QwenImageLayeredPipeline", "Qwen-Image-Layered, which decomposes an image into layers"),
        ("QwenImageControlNetPipeline", "a ControlNet beside the transformer, which conditions on a control image"),
        (
            "QwenImageControlNetInpaintPipeline",
            "a ControlNet beside the transformer, which conditions on a control image",
        ),
    ),
    torch_edits=(("image2image", "QwenImageImg2ImgPipeline"), ("inpainting", "QwenImageInpaintPipeline")),
)
