"""The adapter types ``--method lora`` trains (``--adapter``), all through ``peft`` on the same target layers:

* ``lora``: ``W + (alpha/r) B A``, B (out x r) and A (r x in) (the default; diffusers' layout, or kohya's);
* ``dora``: LoRA plus a learned magnitude per output feature (peft's ``LoraConfig(use_dora=True)``): the file is
  diffusers' layout with peft's ``lora_magnitude_vector`` keys, which ``load_lora_weights`` reads;
* ``lokr``: a Kronecker product ``W + (alpha/r) (w1 ⊗ w2)``, w2 of rank r (peft's ``LoKrConfig``);
* ``loha``: a Hadamard product of two rank-r products ``W + (alpha/r) (B1 A1) ⊙ (B2 A2)`` (peft's ``LoHaConfig``).

diffusers' ``load_lora_weights`` does not read peft's LoKr and LoHa weights, so those two are saved in peft's own
layout, ``adapter_model.safetensors`` and ``adapter_config.json``, which ``PeftModel.from_pretrained`` or
``peft.inject_adapter_in_model`` + ``set_peft_model_state_dict`` load onto the pipeline's denoiser.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from xeonsd.contracts.method_names import PEFT_ADAPTERS, PEFT_FILES
from xeonsd.trainer.config import ConfigError

PEFT_WEIGHTS, PEFT_CONFIG = PEFT_FILES


def in_peft_layout(adapter: str) -> bool:
    """Whether ``adapter`` is saved in peft's layout (diffusers' loaders do not read it)."""
    return adapter in PEFT_ADAPTERS


def check_adapter(cfg) -> None:
    """Refuse what another adapter type than LoRA cannot do, one line naming the option and the fix."""
    if cfg.adapter == "lora":
        return
    if cfg.train_text_encoder:
        raise ConfigError(
            f"--adapter {cfg.adapter} adapts the denoiser only: leave out --train_text_encoder, or use --adapter lora"
        )
    if cfg.save_format == "kohya":
        raise ConfigError(
            f"--save_format kohya: the kohya layout holds plain LoRA; --adapter {cfg.adapter} is saved in "
            f"{'peft' if in_peft_layout(cfg.adapter) else 'diffusers'}' layout (leave out --save_format)"
        )


def adapter_config(adapter: str, rank: int, alpha: float, targets: list[str], fused: bool = True):
    """peft's config for one adapter type. ``fused`` (plain LoRA only): the adapted linears are
    :class:`.lora_layer.FusedLoraLinear` (peft's layer with the forward in the compute dtype), else peft's own."""
    if adapter == "lokr":
        from peft import LoKrConfig

        return LoKrConfig(r=rank, alpha=alpha, target_modules=targets)
    if adapter == "loha":
        from peft import LoHaConfig

        return LoHaConfig(r=rank, alpha=alpha, target_modules=targets)
    from peft import LoraConfig

    dora = adapter == "dora"
    config = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=targets, use_dora=dora)
    if fused and not dora:
        from xeonsd.trainer.methods.lora_layer import FusedLoraLinear

        config._register_custom_module({torch.nn.Linear: FusedLoraLinear})  # peft's (experimental) custom layers
    return config


def save_peft_layout(denoiser: torch.nn.Module, out: Path) -> None:
    """The denoiser's adapter in peft's layout, what ``PeftModel.from_pretrained(denoiser, out)`` loads: its
    weights (peft's names behind ``base_model.model.``) and config, written beside the result, then moved in."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    state = get_peft_model_state_dict(denoiser)
    with tempfile.TemporaryDirectory(prefix=".adapter.tmp-", dir=out) as tmp:
        save_file({f"base_model.model.{k}": v.detach().contiguous() for k, v in state.items()}, f"{tmp}/{PEFT_WEIGHTS}")
        denoiser.peft_config["default"].save_pretrained(tmp)
        for name in PEFT_FILES:
            os.replace(Path(tmp) / name, out / name)
