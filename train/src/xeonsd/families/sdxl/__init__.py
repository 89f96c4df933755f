"""SDXL: what its pipeline is (:data:`SPEC`, detected from its config files) and, in :mod:`.training`, how it
trains. SDXL."""

from __future__ import annotations

from xeonsd.families.spec import FamilySpec

SPEC = FamilySpec(
    "sdxl",
    "SDXL",
    "StableDiffusionXLPipeline",
    "OVStableDiffusionXLPipeline",
    ("text_encoder", "text_encoder_2"),
    ("tokenizer", "tokenizer_2"),
    pooled=True,
    addition_embed_type="text_time",
    concept_layout="xl",
    kohya_te_numbered=True,
    lora_marks=(
        (r"^lora_te2_", "it adapts a second text encoder (text_encoder_2)"),
        (r"^lora_unet_up_blocks_0_attentions_", "it adapts attention in the UNet's first up block"),
    ),
    text_widths=(2048,),
    genai_text_adapters=False,
    pipeline_aliases=("StableDiffusionXLImg2ImgPipeline",),
    example_scripts=(("lora", "text_to_image/train_text_to_image_lora_sdxl.py"),),
    torch_edits=(
        ("image2image", "StableDiffusionXLImg2ImgPipeline"),
        ("inpainting", "StableDiffusionXLInpaintPipeline"),
    ),
)
