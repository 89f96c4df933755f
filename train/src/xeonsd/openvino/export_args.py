"""The command line of ``xeonsd export``, made from :class:`ExportRequest`'s fields (:mod:`xeonsd.flags`);
:func:`xeonsd.openvino.export.main_args` turns a request into :class:`~xeonsd.openvino.export_inputs.ExportOptions`
(the static shape and the quantization are made from several flags each). Light imports only: ``xeonsd --help``
builds this parser."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from xeonsd.flags import flag
from xeonsd.openvino.export_inputs import WEIGHT_FORMATS
from xeonsd.openvino.quantize import DEFAULT_SAMPLES, METHODS


@dataclass(frozen=True)
class ExportRequest:
    """``xeonsd export SRC OUT [flags]``: each field is a flag (dashed: ``--batch-size``)."""

    src: str = flag(
        "diffusers pipeline directory (e.g. --save_as_full_pipeline output) or Hub model id", positional=True
    )
    out: Path = flag("output directory (must not exist or be empty unless --overwrite)", positional=True)
    embeds: Path | None = flag(
        "learned_embeds.safetensors to add to tokenizer and text encoder before export", default=None
    )
    token: str | None = flag("load the --embeds concept under this token instead of the one in the file", default=None)
    batch_size: int = flag("prompts per call (static shape)", default=5)
    resolution: int | None = flag(
        "height and width of the static shape (default: the family's, SDXL 1024)", default=None
    )
    height: int | None = flag("static height (default --resolution)", default=None)
    width: int | None = flag("static width (default --resolution)", default=None)
    num_images_per_prompt: int = flag("images per prompt of a call (static shape)", default=1)
    dynamic: bool = flag("keep dynamic shapes (skip the static reshape)", default=False)
    weight_format: str | None = flag(
        "int8: NNCF data-free 8-bit weight compression (default fp32; int8 with --quantize)",
        default=None,
        choices=WEIGHT_FORMATS,
    )
    quantize: str | None = flag(
        "int8 UNet convolutions and attention (NNCF), calibrated offline, and int8 weights in the text "
        "encoder(s) and VAE; hybrid keeps the UNet's linear layers as exported (fastest on AMX), hybrid-compact "
        "stores them in int8 too (a quarter of the UNet's size)",
        default=None,
        choices=METHODS,
    )
    calibration_prompts: Path | None = flag(
        "--quantize: one prompt a line (default: the recipe's prompt and the object templates)",
        default=None,
        metavar="FILE",
    )
    calibration_samples: int | None = flag(
        f"--quantize: UNet calls recorded for calibration (default {DEFAULT_SAMPLES})", default=None, metavar="N"
    )
    tome: str = flag(
        "token merging: merge this share (0-0.75) of the tokens before the self-attention of the UNet's "
        "largest transformer blocks, in the exported graph (static exports; default 0: none)",
        default="0",
        metavar="RATIO",
    )
    tome_mlp: bool = flag("--tome: merge before those blocks' feed-forward too", default=False)
    overwrite: bool = flag("replace an existing OUT (only once the new one is done)", default=False)
    lora: Path | None = flag(
        "adapter fused into the weights before export: a LoRA or DoRA file (pytorch_lora_weights.safetensors), "
        "or a LoKr/LoHa run's adapter_model.safetensors or directory; one self-contained directory, usable with "
        "--engine optimum",
        default=None,
        metavar="FILE",
    )
    lora_scale: float = flag("strength of the fused --lora (default 1.0)", default=1.0, metavar="S")
