"""FLUX.1: what its pipeline is (:data:`SPEC`, detected from its config files) and, in :mod:`.training`, how it
trains. FLUX.1 (dev: guidance embedding; schnell: none): CLIP-L's pooled output and T5's hidden states condition a 2x2-packed token transformer trained with rectified flow."""

from __future__ import annotations

from xeonsd.families.spec import FamilySpec

SPEC = FamilySpec(
    "flux",
    "FLUX.1",
    "FluxPipeline",
    "OVFluxPipeline",
    ("text_encoder", "text_encoder_2"),
    ("tokenizer", "tokenizer_2"),
    denoiser="transformer",
    denoiser_class="FluxTransformer2DModel",
    encoder_classes=("CLIPTextModel", "T5EncoderModel"),
    objective="flow",
    latent_multiple=2,
    max_sequence_length=512,
    kohya="bfl",
    kohya_te_numbered=True,
    lora_marks=(
        (
            r"^lora_transformer_single_transformer_blocks_\d+_(attn_to_[qkv]|proj_mlp|proj_out|norm_linear)$",
            "it adapts FLUX.1's single-stream transformer blocks",
        ),
    ),
    guidance_scale=3.5,
    negative_prompt_cfg=False,
    pipeline_aliases=("FluxImg2ImgPipeline", "FluxInpaintPipeline"),
    variants=(
        ("FluxFillPipeline", "FLUX.1 Fill, an inpainting model whose input carries the image and the mask"),
        ("FluxControlPipeline", "FLUX.1 Canny/Depth, whose input carries a control image"),
        ("FluxControlImg2ImgPipeline", "FLUX.1 Canny/Depth, whose input carries a control image"),
        ("FluxControlInpaintPipeline", "FLUX.1 Canny/Depth, whose input carries a control image"),
        ("FluxControlNetPipeline", "a ControlNet beside the transformer, which conditions on a control image"),
        ("FluxControlNetImg2ImgPipeline", "a ControlNet beside the transformer, which conditions on a control image"),
        ("FluxControlNetInpaintPipeline", "a ControlNet beside the transformer, which conditions on a control image"),
        ("VisualClozePipeline", "VisualCloze, which takes in-context example images"),
        ("VisualClozeGenerationPipeline", "VisualCloze, which takes in-context example images"),
    ),
    torch_edits=(("image2image", "FluxImg2ImgPipeline"), ("inpainting", "FluxInpaintPipeline")),
)
