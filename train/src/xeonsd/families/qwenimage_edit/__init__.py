"""Qwen-Image-Edit-2509/2511: what its pipeline is (:data:`SPEC`, detected from its config files: Qwen-Image's
transformer in a ``QwenImageEditPlusPipeline``), in :mod:`.training` how it trains, in :mod:`.assets` its offline
pipelines. An edit model: the prompt is an instruction, and 1 to 3 reference images enter twice, through
Qwen2.5-VL's vision tower beside the instruction and as latent tokens beside the generated image's. It trains on
image pairs only (``--cond_image_column``: a reference path, or a list of up to 3): its pipeline needs a
reference. optimum-intel
2.2 has no export for it."""

from __future__ import annotations

from xeonsd.families.spec import FamilySpec

SPEC = FamilySpec(
    "qwenimage_edit",
    "Qwen-Image-Edit-2511",
    "QwenImageEditPlusPipeline",
    "",  # no OVQwenImageEdit pipeline in optimum-intel 2.2
    ("text_encoder",),
    ("tokenizer",),
    denoiser="transformer",
    denoiser_class="QwenImageTransformer2DModel",
    encoder_classes=("Qwen2_5_VLForConditionalGeneration",),
    vae_class="AutoencoderKLQwenImage",
    objective="flow",
    latent_multiple=2,
    # the pipeline encodes the instruction and the reference images' vision tokens whole (no truncation); 1024 is
    # the most its check_inputs allows
    max_sequence_length=1024,
    kohya=None,
    shared_adapters=True,  # Qwen-Image's transformer: its adapters apply, and its own read as Qwen-Image's
    genai_adapters=False,
    genai_edits=(),
    guidance_scale=4.0,  # the pipeline's true_cfg_scale; without a negative prompt it runs no CFG
    negative_prompt_cfg=False,
    resolution_shift=False,
    reference_images=3,
    reference_required=True,  # QwenImageEditPlusPipeline needs image=: it trains on pairs
    processor="processor",
    # Qwen-Image-Edit's first release and its inpainting are refused as Qwen-Image's variants (same transformer)
)
