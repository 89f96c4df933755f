"""FLUX.2 [dev]: what its pipeline is (:data:`SPEC`, detected from its config files: FLUX.2's transformer in a
``Flux2Pipeline`` with a Mistral3 text encoder), in :mod:`.training` how it trains, in :mod:`.assets` its offline
pipelines. FLUX.2 [dev] (32B): Mistral Small 3.2 (24B) as the text encoder, its hidden states at layers 10, 20 and
30 stacked; klein's transformer class and VAE at larger widths, with a guidance embedding (guidance-distilled: no
classifier-free guidance). Its pipeline takes reference images (``image=``), so it trains on image pairs
(``--cond_image_column``, as diffusers' ``train_dreambooth_lora_flux2_img2img.py``) or on images alone (as
``train_dreambooth_lora_flux2.py``). optimum-intel 2.2 has no export for it."""

from __future__ import annotations

from xeonsd.families.spec import FamilySpec

SPEC = FamilySpec(
    "flux2_dev",
    "FLUX.2 [dev]",
    "Flux2Pipeline",
    "",  # no OVFlux2Pipeline in optimum-intel 2.2
    ("text_encoder",),
    ("tokenizer",),
    denoiser="transformer",
    denoiser_class="Flux2Transformer2DModel",
    encoder_classes=("Mistral3ForConditionalGeneration",),
    vae_class="AutoencoderKLFlux2",
    objective="flow",
    latent_multiple=2,
    max_sequence_length=512,
    kohya=None,  # ComfyUI loads FLUX.2 adapters in diffusers' layout
    # klein's module names: an adapter's file does not tell the two apart (their widths do, checked against the
    # model where an adapter is applied), so each takes the other's
    shared_adapters=True,
    genai_adapters=False,
    genai_edits=(),
    guidance_scale=4.0,
    negative_prompt_cfg=False,
    resolution_shift=False,
    reference_images=1,  # Flux2Pipeline(image=...): trained on pairs as train_dreambooth_lora_flux2_img2img.py
)
