"""Krea 2: what its pipeline is (:data:`SPEC`, detected from its config files: a ``Krea2Transformer2DModel`` in a
``Krea2Pipeline`` with a ``Qwen3VLModel`` text encoder), in :mod:`.training` how it trains, in :mod:`.assets` its
offline pipelines. Krea 2 (12B): a single-stream DiT whose text input is a stack of hidden states tapped from several
Qwen3-VL layers (the pipeline's ``text_encoder_select_layers``), fused by the transformer's own text blocks; Qwen-Image's
VAE. It ships as RAW (the base, for training) and Turbo (8-step distilled, ``is_distilled``, for inference): train
on RAW and validate on Turbo with ``--inference_model``. optimum-intel 2.2 has no export for it."""

from __future__ import annotations

from xeonsd.families.spec import FamilySpec

SPEC = FamilySpec(
    "krea2",
    "Krea 2",
    "Krea2Pipeline",
    "",  # no OVKrea2Pipeline in optimum-intel 2.2
    ("text_encoder",),
    ("tokenizer",),
    pipeline_config=("text_encoder_select_layers", "is_distilled", "patch_size"),
    denoiser="transformer",
    denoiser_class="Krea2Transformer2DModel",
    encoder_classes=("Qwen3VLModel",),
    vae_class="AutoencoderKLQwenImage",
    objective="flow",
    latent_multiple=2,
    max_sequence_length=512,
    kohya=None,  # ComfyUI loads the diffusers layout
    lora_marks=(
        (r"^lora_transformer_transformer_blocks_\d+_attn_to_gate$", "it adapts Krea 2's attention output gates"),
        (
            r"^lora_transformer_(text_fusion_|txt_in_linear_[12]$|time_mod_proj$|final_layer_linear$)",
            "it adapts Krea 2's text fusion, text projection, time modulation or final layer",
        ),
    ),
    genai_adapters=False,
    genai_edits=(),
    guidance_scale=4.5,  # Krea2Pipeline's (RAW); Turbo runs without guidance
    negative_prompt_cfg=True,
    resolution_shift=False,  # train_dreambooth_lora_krea2.py draws σ from the unshifted training grid
)
