"""FLUX.1 Kontext: what its pipeline is (:data:`SPEC`, detected from its config files: FLUX.1's transformer in a
``FluxKontextPipeline``), in :mod:`.training` how it trains, in :mod:`.assets` its offline pipelines. An edit model:
the prompt is an instruction and a reference image's tokens join the generated image's, so it trains on image pairs
(``--cond_image_column``, as diffusers' ``train_dreambooth_lora_flux_kontext.py``), or on images alone as FLUX.1.
optimum-intel 2.2 has no export for it."""

from __future__ import annotations

from xeonsd.families.spec import FamilySpec

SPEC = FamilySpec(
    "flux_kontext",
    "FLUX.1 Kontext",
    "FluxKontextPipeline",
    "",  # no OVFluxKontextPipeline in optimum-intel 2.2
    ("text_encoder", "text_encoder_2"),
    ("tokenizer", "tokenizer_2"),
    denoiser="transformer",
    denoiser_class="FluxTransformer2DModel",
    encoder_classes=("CLIPTextModel", "T5EncoderModel"),
    objective="flow",
    latent_multiple=2,
    max_sequence_length=512,
    kohya="bfl",  # FLUX.1's transformer: BFL's names, as ComfyUI loads Kontext LoRAs
    kohya_te_numbered=True,
    shared_adapters=True,  # FLUX.1's transformer: FLUX.1's adapters apply, and its own read as FLUX.1's
    genai_adapters=False,
    genai_edits=(),
    guidance_scale=3.5,
    negative_prompt_cfg=False,
    reference_images=1,
    variants=(
        ("FluxKontextInpaintPipeline", "FLUX.1 Kontext's inpainting, which takes a mask beside the reference image"),
    ),
)
