"""``xeonsd bench generate`` on the flow-matching families (FLUX.1, SD3/SD3.5): how their pipeline is called and
what one image costs in FLOPs.

These models have no textual-inversion concept (no trainer trains one for them, and ``xeonsd export`` refuses
``--embeds`` on them), so every variant runs the plain base model with a prompt without the concept's token. The
PyTorch variants call the diffusers pipeline as ``xeonsd generate`` does: the family's guidance scale (FLUX.1-dev
3.5 through its guidance embedding, no classifier-free guidance; SD3 7.0 with classifier-free guidance) and T5 at
the export's prompt length (:func:`xeonsd.openvino.pipelines.max_sequence_length`).

The FLOPs of one image (:func:`flow_pipeline_flops`), counted with ``torch.utils.flop_counter`` on networks built
on the meta device from the pipeline's configs, as for the UNet families: the text encoders (CLIP(s) at 77 tokens,
T5 at the prompt length; prompt and negative prompt under classifier-free guidance), ``steps`` transformer calls
(at batch 2 under classifier-free guidance, i.e. two calls' worth per step) and the VAE decoder.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from xeonsd.families import FamilySpec, detect_family, tokenizer_limit, vae_scale

PLAIN_PROMPT = "a yellow robot at the beach, high quality"  # the recipe's prompt without the concept's token
CLIP_LENGTH = 77


def flow_family(model: Path) -> Any:
    """The detected family of ``model`` when it is a flow-matching one (FLUX.1, SD3), else None."""
    family = detect_family(str(model))
    return family if family.is_flow else None


def transformer_calls_per_step(family: FamilySpec) -> int:
    """Transformer calls' worth of work per denoising step: SD3 runs classifier-free guidance at its guidance scale
    (prompt and negative prompt, one call at batch 2); FLUX.1's pipeline runs it only with ``true_cfg_scale`` > 1
    and a negative prompt (dev's guidance is an embedding, schnell has none), neither of which is given
    (``FamilySpec.negative_prompt_cfg``)."""
    found = family
    return 2 if found.negative_prompt_cfg and found.guidance_scale > 1 else 1


def prompt_length(model: Path, family: FamilySpec) -> int:
    """T5's prompt length the export fixes for ``model`` (:meth:`FamilySpec.prompt_length_of`)."""
    length = family.prompt_length_of(model)
    assert length is not None
    return length


def torch_call_kwargs(model: Path, family: FamilySpec) -> dict[str, Any]:
    """What the diffusers pipeline of a flow family is called with besides the prompt, size and steps: the guidance
    scale ``xeonsd generate`` uses for ``family`` (and so every variant of the bench) and T5's prompt length."""
    return {"guidance_scale": family.guidance_scale, "max_sequence_length": prompt_length(model, family)}


def flops_of(fn: Callable[[], Any]) -> float:
    """FLOPs of ``fn()`` run on the meta device (nothing is computed)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.no_grad(), torch.device("meta"):
        fn()
    return float(counter.get_total_flops())


def _vae(model: Path, family: FamilySpec) -> tuple[Any, int]:
    import diffusers

    cls = getattr(diffusers, family.vae_class)
    config = cls.load_config(model / "vae")
    return cls.from_config(config), vae_scale(config)


def transformer_call_flops(model: Path, family: FamilySpec, height: int, width: int, batch: int = 1) -> float:
    """FLOPs of one transformer call at ``batch`` for ``height`` x ``width`` images."""
    import diffusers
    import torch

    cls = getattr(diffusers, family.denoiser_class)
    with torch.device("meta"):
        transformer = cls.from_config(cls.load_config(model / "transformer"))
        vae, scale = _vae(model, family)
    side = family.training
    dims = side.latent_dims(vae.config, scale, height, width)
    # the transformer's text sequence: T5's tokens (FLUX.1), CLIP's 77 followed by T5's (SD3: clip_context_tokens)
    text = prompt_length(model, family) + family.clip_context_tokens
    return flops_of(lambda: transformer(**side.meta_inputs(transformer.config, batch, dims, text, torch.float32)))


def _text_encoders(model: Path, family: FamilySpec) -> list[tuple[Any, int]]:
    """Each text encoder (meta device) with the token count it is called on."""
    import torch
    import transformers

    found = family
    out = []
    with torch.device("meta"):
        for i, (encoder, tokenizer) in enumerate(found.text_side):
            cls = found.text_encoder_class(i)
            config = transformers.AutoConfig.from_pretrained(model / encoder)
            length = (
                prompt_length(model, family)
                if cls.startswith("T5")
                else tokenizer_limit(model, tokenizer) or CLIP_LENGTH
            )
            out.append((getattr(transformers, cls)(config), length))
    return out


def flow_pipeline_flops(model: Path, family: FamilySpec, height: int, width: int, steps: int) -> dict[str, float]:
    """FLOPs of one image: text encoders, ``steps`` x the transformer (x 2 under classifier-free guidance), VAE
    decoder."""
    import torch

    calls = transformer_calls_per_step(family)
    with torch.device("meta"):
        vae, scale = _vae(model, family)
    h, w = height // scale, width // scale
    encoders = _text_encoders(model, family)
    out = {
        "text_encoder": sum(flops_of(lambda e=e, n=n: e(torch.zeros(calls, n, dtype=torch.long))) for e, n in encoders),
        "transformer": steps * transformer_call_flops(model, family, height, width, batch=calls),
        "vae_decoder": flops_of(lambda: vae.decode(torch.randn(1, vae.config.latent_channels, h, w))),
    }
    out["total"] = sum(out.values())
    return out


def flops_line(report: dict[str, Any]) -> str:
    """The table's FLOP line for a flow model."""
    f, steps = report["flops_per_image"], report["steps"]
    calls = report.get("transformer_calls_per_step", 1)
    how = "batch 2, classifier-free guidance" if calls == 2 else "1 call, no classifier-free guidance"
    return (
        f"FLOPs per image: {f['total'] / 1e12:.2f} TFLOP (transformer {f['transformer'] / 1e12:.2f} = {steps} x "
        f"{how}, text encoders {f['text_encoder'] / 1e12:.3f}, VAE decoder {f['vae_decoder'] / 1e12:.3f})"
    )
