"""SD 1.x/2.x: what its pipeline is (:data:`SPEC`, detected from its config files) and, in :mod:`.training`, how it
trains. SD 1.x/2.x."""

from __future__ import annotations

from xeonsd.families.spec import FamilySpec

SPEC = FamilySpec(
    "sd",
    "SD 1.x/2.x",
    "StableDiffusionPipeline",
    "OVStableDiffusionPipeline",
    ("text_encoder",),
    ("tokenizer",),
    pipeline_kwargs=(("safety_checker", None), ("requires_safety_checker", False)),
    concept_layout="sd",
    lora_marks=((r"^lora_unet_down_blocks_0_attentions_", "it adapts attention in the UNet's first down block"),),
    text_widths=(768, 1024),
    pipeline_aliases=("StableDiffusionImg2ImgPipeline",),
    example_scripts=(
        ("textual_inversion", "textual_inversion/textual_inversion.py"),
        ("lora", "text_to_image/train_text_to_image_lora.py"),
        ("full", "text_to_image/train_text_to_image.py"),
    ),
    torch_edits=(("image2image", "StableDiffusionImg2ImgPipeline"), ("inpainting", "StableDiffusionInpaintPipeline")),
)
