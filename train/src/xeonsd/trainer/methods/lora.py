"""LoRA: low-rank adapters on the UNet's attention projections (and optionally the text encoder's), via ``peft``.

The base UNet stays frozen in the training dtype (bf16 on AMX); the adapters, their optimizer state and the loss
are fp32, and the adapters compute in the training dtype from those fp32 weights (:mod:`.lora_layer`;
``--no-fused_lora``: peft's forward, which casts each adapter's input to fp32). The result is
``pytorch_lora_weights.safetensors`` in the diffusers layout: ``pipe.load_lora_weights(dir)`` loads it; with
``--save_format kohya`` the same file in the kohya layout AUTOMATIC1111, Forge and ComfyUI load (diffusers reads it
too), through :mod:`xeonsd.modelfiles.lora_layout`. On SDXL ``--train_text_encoder`` puts adapters on both text encoders, saved
as ``text_encoder.*`` and ``text_encoder_2.*`` (the layout ``StableDiffusionXLPipeline.load_lora_weights`` reads).
``--adapter dora|lokr|loha`` trains another adapter type on the same layers (:mod:`.adapters`);
``--base_precision int8`` holds the denoiser's frozen linear layers in int8 (:mod:`.int8_base`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from xeonsd.contracts.method_names import COMFYUI_FILE, result_file
from xeonsd.cpu import cpu_info
from xeonsd.families import family_spec
from xeonsd.modelfiles.lora_comfyui import write_comfyui
from xeonsd.modelfiles.lora_layout import convert
from xeonsd.trainer.checkpoint import CheckpointError
from xeonsd.trainer.config import ConfigError
from xeonsd.trainer.methods.adapters import PEFT_FILES, adapter_config, check_adapter, in_peft_layout, save_peft_layout
from xeonsd.trainer.methods.base import Method, PlainText
from xeonsd.trainer.pipelines import pipeline_class
from xeonsd.trainer.prompt_tables import check_prompt_source

if TYPE_CHECKING:
    from xeonsd.families import Family
    from xeonsd.trainer.captions import Captions

log = logging.getLogger(__name__)
LORA_FILE = result_file("lora")
TEXT_ENCODER_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")


def target_modules(cfg, family: Family | None = None) -> list[str]:
    """The denoiser's layers that get adapters: ``--lora_target_modules`` (``--lora_layers``), or the family's
    default (the attention projections; FLUX.1 and SD3 with their text stream's)."""
    if cfg.lora_target_modules is None:
        return list(family_spec(family).training.lora_targets)
    return [m.strip() for m in cfg.lora_target_modules.split(",") if m.strip()]


def _alpha(cfg) -> float:
    """``--lora_alpha``, by default ``--rank`` (a scale of 1)."""
    return cfg.lora_alpha if cfg.lora_alpha is not None else cfg.rank


def unet_lora_config(cfg, family: Family | None = None):
    """The denoiser adapters' peft config for this run (the trainer and the memory estimate use the same one)."""
    return adapter_config(cfg.adapter, cfg.rank, _alpha(cfg), target_modules(cfg, family), cfg.fused_lora)


def _adapters_in_fp32(modules) -> list[torch.nn.Parameter]:
    """The trainable parameters of ``modules`` (the adapters), moved to fp32: they train in fp32 beside the bf16
    base."""
    params = [p for module in modules for p in module.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    return params


def _int8_base(denoiser: torch.nn.Module) -> None:
    """``--base_precision int8``: the denoiser's frozen linears in int8, and one line on what the CPU runs them on."""
    from xeonsd.trainer.methods.int8_base import quantize_frozen_linears

    swapped, held = quantize_frozen_linears(denoiser)
    cpu = cpu_info()
    units = cpu.native_int8
    log.info("--base_precision int8: %d frozen linear layers (%.2f GB of weights) now int8", swapped, held / 1e9)
    if units != "AMX-INT8":  # measured on Zen 4 (VNNI): 0.98x the bf16 step's time, 0.19 GB less peak RSS
        log.warning(
            "--base_precision int8 on a CPU without AMX-INT8 (%s): the int8 matmuls run on %s; %s "
            "(xeonsd bench train --method lora --extra measures it here)",
            cpu.model,
            units or "no int8 dot-product unit",
            "expect memory saved, not time (docs/benchmarks.md#int8-frozen-layers)"
            if units
            else "expect a slower step than --base_precision dtype",
        )


class LoRA(Method):
    name = "lora"
    outputs = (LORA_FILE,)
    # --adapter lokr|loha: peft's layout (the instance's outputs); --save_format comfyui: ComfyUI's file beside
    other_outputs = (*PEFT_FILES, COMFYUI_FILE)

    @classmethod
    def check(cls, cfg, captions: Captions | None) -> None:
        if cfg.rank < 1:
            raise ConfigError(f"--rank must be at least 1, got {cfg.rank}")
        if cfg.lora_alpha is not None and cfg.lora_alpha <= 0:
            raise ConfigError(f"--lora_alpha must be positive, got {cfg.lora_alpha}")
        if cfg.lora_target_modules is not None and not target_modules(cfg):
            raise ConfigError("--lora_target_modules names no module")
        if importlib.util.find_spec("peft") is None:
            raise ConfigError("--method lora needs the peft package (pip install -r requirements.txt)")
        check_adapter(cfg)
        if cfg.base_precision == "int8" and cfg.adapter != "lora":
            raise ConfigError(
                f"--base_precision int8 takes --adapter lora, not {cfg.adapter}: its layers read the frozen weight "
                "itself (DoRA's magnitude, LoKr/LoHa's merge). Fix: --adapter lora or --base_precision dtype"
            )
        check_prompt_source(cls.name, cfg, cls.uses_captions(cfg, captions))

    @classmethod
    def memory_trainable(cls, cfg, unet, encoders, family: Family | None = None) -> int:
        """The adapters, added to the meta denoiser in fp32; with --train_text_encoder about the same share of each
        CLIP text encoder's attention (never T5's)."""
        unet.add_adapter(unet_lora_config(cfg, family))
        trainable = sum(p.numel() for p in _adapters_in_fp32([unet]))
        if cfg.train_text_encoder:
            clips = [c for c, _ in encoders if getattr(c, "model_type", "") != "t5"]
            trainable += sum(4 * c.num_hidden_layers * 2 * cfg.rank * c.hidden_size for c in clips)
        return trainable

    def __init__(self, cfg, models) -> None:
        super().__init__(cfg, models)
        self.alpha = _alpha(cfg)
        self.outputs = PEFT_FILES if in_peft_layout(cfg.adapter) else (LORA_FILE,)
        try:
            models.unet.add_adapter(unet_lora_config(cfg, models.family))
        except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
            raise ConfigError(f"--lora_target_modules {cfg.lora_target_modules}: {exc}") from exc
        encoders = list(self._encoders().values())  # SDXL, SD3: both CLIPs; never T5
        if cfg.train_text_encoder:
            for encoder in encoders:
                config = adapter_config("lora", cfg.rank, self.alpha, list(TEXT_ENCODER_TARGETS), cfg.fused_lora)
                encoder.add_adapter(config)
        if cfg.gradient_checkpointing:
            models.unet.enable_gradient_checkpointing()
        self.params = _adapters_in_fp32([models.unet, *encoders])
        if cfg.base_precision == "int8":
            _int8_base(models.unet)

    @classmethod
    def text_first(cls, cfg) -> PlainText | None:
        return None if cfg.train_text_encoder else PlainText(cls, cfg)

    @property
    def trains_text_encoder(self) -> bool:
        return self.cfg.train_text_encoder

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.params

    def _layers(self) -> dict[str, dict[str, torch.Tensor]]:
        from diffusers.utils import convert_state_dict_to_diffusers
        from peft.utils import get_peft_model_state_dict

        layers = {f"{self._denoiser}_lora_layers": get_peft_model_state_dict(self.models.unet)}
        if self.cfg.train_text_encoder:
            for name, encoder in self._encoders().items():
                layers[f"{name}_lora_layers"] = get_peft_model_state_dict(encoder)
        # A UNet's file in the diffusers layout (lora.down/lora.up), as diffusers' UNet scripts save it; a
        # transformer's in peft's (lora_A/lora_B), as train_dreambooth_lora_flux.py / _sd3.py save it.
        keep = self._denoiser == "transformer"
        return {
            k: {n: t.detach().clone() for n, t in (v if keep else convert_state_dict_to_diffusers(v)).items()}
            for k, v in layers.items()
        }

    def _metadata(self) -> dict[str, dict]:
        """The adapters' configs (rank, alpha, targets) stored in the file's metadata, where diffusers'
        ``load_lora_weights`` (and our GenAI conversion) read them: without them a reader takes alpha = rank."""
        meta = {f"{self._denoiser}_lora_adapter_metadata": self.models.unet.peft_config["default"].to_dict()}
        if self.cfg.train_text_encoder:
            for name, encoder in self._encoders().items():
                meta[f"{name}_lora_adapter_metadata"] = encoder.peft_config["default"].to_dict()
        return meta

    @property
    def _denoiser(self) -> str:
        """The denoiser's component name, the prefix of its keys in the file (``unet``, ``transformer``)."""
        return family_spec(self.models.family).denoiser

    def _encoders(self) -> dict[str, torch.nn.Module]:
        """The text encoders that may get adapters, by their pipeline component name (``text_encoder``, SDXL's and
        SD3's ``text_encoder_2``; never T5)."""
        names = family_spec(self.models.family).text_encoders
        allowed = set(family_spec(self.models.family).clip_encoders)
        return {n: e for n, (_, e) in zip(names, self.models.text_pairs, strict=False) if n in allowed}

    def _settings(self) -> dict:
        """What the adapters are: a checkpoint of other adapters is refused."""
        return {
            "adapter": self.cfg.adapter,
            "rank": self.cfg.rank,
            "alpha": self.alpha,
            "targets": target_modules(self.cfg, self.models.family),
            "text_encoder": self.cfg.train_text_encoder,
        }

    def state(self) -> dict:
        return {"adapters": [p.detach().clone() for p in self.params], **self._settings()}

    def load_state(self, state: dict, where: str) -> None:
        mine = self._settings()
        theirs = {k: state.get(k, "lora" if k == "adapter" else None) for k in mine}  # before --adapter: lora
        if theirs != mine:
            diff = ", ".join(f"{k} {theirs[k]} (now {mine[k]})" for k in mine if theirs[k] != mine[k])
            raise CheckpointError(f"checkpoint {where} holds other adapters: {diff}")
        with torch.no_grad():
            for p, saved in zip(self.params, state["adapters"], strict=True):
                p.copy_(saved)

    def save(self, out: Path) -> None:
        if in_peft_layout(self.cfg.adapter):  # diffusers' loaders do not read peft's LoKr/LoHa weights
            save_peft_layout(self.models.unet, out)
        else:
            self._save_lora_file(out)
        if self.cfg.save_format == "comfyui":  # beside the result: ComfyUI's names, alpha and DoRA scale per module
            encoders = self._encoders() if self.cfg.train_text_encoder else {}
            write_comfyui({self._denoiser: self.models.unet, **encoders}, out / COMFYUI_FILE, self._comfyui_metadata())

    def _comfyui_metadata(self) -> dict[str, str]:
        return {"xeonsd_adapter": self.cfg.adapter, "xeonsd_family": family_spec(self.models.family).name}

    def _save_lora_file(self, out: Path) -> None:
        # save_lora_weights writes into a directory: write it beside the result, then move the file in.
        with tempfile.TemporaryDirectory(prefix=".lora.tmp-", dir=out) as tmp:
            pipeline_class(self.models.family).save_lora_weights(
                tmp, safe_serialization=True, **self._layers(), **self._metadata()
            )
            if self.cfg.save_format == "kohya":  # the same adapter in the layout the UIs load (alpha per module)
                family = family_spec(self.models.family)  # SDXL's text encoders: lora_te1_, lora_te2_
                convert(Path(tmp) / LORA_FILE, out / LORA_FILE, "kohya", family=family)
            else:
                os.replace(Path(tmp) / LORA_FILE, out / LORA_FILE)

    def summary(self) -> dict:
        return {**super().summary(), "adapter": self.cfg.adapter, "lora_rank": self.cfg.rank, "lora_alpha": self.alpha}
