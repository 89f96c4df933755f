"""Z-Image: what its pipeline is (:data:`SPEC`, detected from its config files) and, in :mod:`.training`, how it
trains. Z-Image (6B): one Qwen3 text encoder, a single-stream transformer with its noise and context refiners."""

from __future__ import annotations

from xeonsd.families.spec import FamilySpec

SPEC = FamilySpec(
    "zimage",
    "Z-Image",
    "ZImagePipeline",
    "OVZImagePipeline",
    ("text_encoder",),
    ("tokenizer",),
    denoiser="transformer",
    denoiser_class="ZImageTransformer2DModel",
    encoder_classes=("Qwen3Model",),
    objective="flow",
    latent_multiple=2,
    max_sequence_length=512,
    kohya=None,
    lora_marks=(
        (
            r"^lora_transformer_(noise_refiner|context_refiner|layers)_\d+_",
            "it adapts Z-Image's refiner or single-stream layers",
        ),
    ),
    genai_adapters=False,  # GenAI 2026.4.1's Z-Image pipeline ignores adapters: no effect, no warning
    genai_edits=("image2image",),
    guidance_scale=5.0,
    variants=(
        ("ZImageOmniPipeline", "Z-Image Omni, which conditions on reference images through SigLIP"),
        ("ZImageControlNetPipeline", "a ControlNet beside the transformer, which conditions on a control image"),
        ("ZImageControlNetInpaintPipeline", "a ControlNet beside the transformer, which conditions on a control image"),
    ),
    pipeline_aliases=("ZImageImg2ImgPipeline", "ZImageInpaintPipeline"),
    torch_edits=(("image2image", "ZImageImg2ImgPipeline"), ("inpainting", "ZImageInpaintPipeline")),
)
