"""``xeonsd bench train``'s variants: the optimized run and one run with each optimisation switched off (per
method), the ``--extra`` ones, LoRA's other adapter types (``--adapters``), and the flags every variant of a method
shares."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]
    what: str
    # The whole command when the variant is not ``xeonsd train`` (diffusers' example script); ``--output_dir`` is added.
    command: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()  # the methods it applies to (none: every method)


def variants_for(method: str, dtype: str) -> tuple[Variant, ...]:
    """The optimized run and one run with each optimisation switched off; the precision baseline is the other dtype."""
    other = "fp32" if dtype == "bf16" else "bf16"
    precision = Variant(other, (f"--mixed_precision={'no' if other == 'fp32' else 'bf16'}",), f"{other} weights")
    per_step = Variant("per-step VAE encode", ("--no-latent_cache",), "encode each image with the VAE every step")
    if method == "lora":
        return (
            Variant("optimized", (), f"{dtype} frozen UNet/VAE, fp32 rank-4 adapters, cached latents and prompts"),
            per_step,
            Variant("gradient checkpointing", ("--gradient_checkpointing",), "recompute activations in backward"),
            Variant("peft LoRA forward", ("--no-fused_lora",), "peft's adapter forward, input and output in fp32"),
            precision,
        )
    if method == "full":
        what = "fp32 master weights under bf16 autocast" if dtype == "bf16" else "fp32 UNet"
        return (
            Variant("optimized", (), f"{what}, cached latents and prompts, AdamW"),
            per_step,
            Variant("gradient checkpointing", ("--gradient_checkpointing",), "recompute activations in backward"),
            precision,
        )
    return (
        Variant("optimized", (), f"{dtype} UNet/VAE, cached latents, only the concept's vectors trained"),
        per_step,
        Variant("whole-matrix embedding", ("--train_full_embedding_matrix",), "train + all-reduce vocab x hidden"),
        precision,
    )


def method_args(method: str) -> list[str]:
    if method == "textual_inversion":
        return ["--placeholder_token=<dicoo>", "--initializer_token=toy"]
    return [f"--method={method}", "--instance_prompt=a photo of toy"]


# --adapters: each adapter type the trainer has besides plain LoRA (--adapter), at the same rank and layers.
ADAPTER_VARIANTS = (
    Variant("dora", ("--adapter=dora",), "DoRA: LoRA and a trained magnitude per output feature", methods=("lora",)),
    Variant("lokr", ("--adapter=lokr",), "LoKr: Kronecker products (peft)", methods=("lora",)),
    Variant("loha", ("--adapter=loha",), "LoHa: Hadamard products of two low-rank pairs (peft)", methods=("lora",)),
)

EXTRA_VARIANTS = (
    Variant("channels_last", ("--channels_last",), "UNet in channels_last"),
    Variant("per-tensor AdamW", ("--no-fused_adamw",), "torch.optim.AdamW's default loop instead of the fused kernel"),
    Variant("torch.compile", ("--compile",), "torch.compile(UNet)"),
    Variant("sdpa attention", ("--attention=sdpa",), "torch's SDPA, no query blocks folded into the batch"),
    Variant(
        "int8 base", ("--base_precision=int8",), "frozen linears in int8 (AMX-INT8), adapters bf16", methods=("lora",)
    ),
    # LoRA and full do not flip (their recipes'); this one does, and encodes every image's mirror at start-up too.
    Variant("random flip", ("--random_flip",), "half the examples mirrored, mirrors encoded", methods=("lora", "full")),
)
