"""FLUX.2 [klein]: what its pipeline is (:data:`SPEC`, detected from its config files) and, in :mod:`.training`, how it
trains. FLUX.2 [klein] (4B, 9B): one Qwen3 text encoder whose hidden states at three layers are stacked, a FLUX.2
transformer over 2x2 patchified tokens of a 32-channel VAE (AutoencoderKLFlux2, batch-normalised latents). FLUX.2
[dev] (``Flux2Pipeline`` with a Mistral text encoder, on the same transformer class) is a family of its own
(:mod:`xeonsd.families.flux2_dev`), told apart by the pipeline's class."""

from __future__ import annotations

from xeonsd.families.spec import FamilySpec

SPEC = FamilySpec(
    "flux2",
    "FLUX.2 [klein]",
    "Flux2KleinPipeline",
    "OVFlux2KleinPipeline",
    ("text_encoder",),
    ("tokenizer",),
    denoiser="transformer",
    denoiser_class="Flux2Transformer2DModel",
    encoder_classes=("Qwen3ForCausalLM",),
    vae_class="AutoencoderKLFlux2",
    objective="flow",
    latent_multiple=2,
    max_sequence_length=512,
    kohya=None,
    lora_marks=(
        (
            r"^lora_transformer_single_transformer_blocks_\d+_attn_to_qkv_mlp_proj$",
            "it adapts FLUX.2's fused single-stream projections",
        ),
    ),
    genai_edits=("image2image",),
    guidance_scale=4.0,
    resolution_shift=False,
    variants=(("Flux2KleinKVPipeline", "FLUX.2 [klein] KV, which conditions on cached reference images"),),
    pipeline_aliases=("Flux2KleinInpaintPipeline",),
    reference_images=1,  # Flux2KleinPipeline(image=...): trained on pairs as train_dreambooth_lora_flux2_klein_img2img.py
)
