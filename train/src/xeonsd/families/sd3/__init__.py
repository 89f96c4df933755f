"""SD3/SD3.5: what its pipeline is (:data:`SPEC`, detected from its config files) and, in :mod:`.training`, how it
trains. SD3/SD3.5: CLIP-L and CLIP-G (hidden and pooled) beside T5's hidden states, an MMDiT over 2x2 patches."""

from __future__ import annotations

from xeonsd.families.spec import FamilySpec

SPEC = FamilySpec(
    "sd3",
    "SD3/SD3.5",
    "StableDiffusion3Pipeline",
    "OVStableDiffusion3Pipeline",
    ("text_encoder", "text_encoder_2", "text_encoder_3"),
    ("tokenizer", "tokenizer_2", "tokenizer_3"),
    pooled=True,
    denoiser="transformer",
    denoiser_class="SD3Transformer2DModel",
    encoder_classes=("CLIPTextModelWithProjection", "CLIPTextModelWithProjection", "T5EncoderModel"),
    objective="flow",
    latent_multiple=2,
    max_sequence_length=256,
    clip_context_tokens=77,
    kohya=None,
    lora_marks=((r"^lora_te2_", "it adapts a transformer and a second CLIP text encoder"),),
    genai_adapters=False,
    guidance_scale=7.0,
    weighting_scheme="logit_normal",
    variants=(
        (
            "StableDiffusion3ControlNetPipeline",
            "a ControlNet beside the transformer, which conditions on a control image",
        ),
        (
            "StableDiffusion3ControlNetInpaintingPipeline",
            "a ControlNet beside the transformer, which conditions on a control image",
        ),
    ),
    pipeline_aliases=(
        "StableDiffusion3Img2ImgPipeline",
        "StableDiffusion3InpaintPipeline",
        "StableDiffusion3PAGPipeline",
        "StableDiffusion3PAGImg2ImgPipeline",
    ),
    torch_edits=(("image2image", "StableDiffusion3Img2ImgPipeline"), ("inpainting", "StableDiffusion3InpaintPipeline")),
)
