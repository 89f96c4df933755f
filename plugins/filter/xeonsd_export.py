"""xeonsd_export_args and xeonsd_export_key: the openvino_export role's `xeonsd export` settings as the command's
flags, and as the name of the base model's export kept on the primary (openvino_export_base_cache_dir);
xeonsd_generate_shape_args: the same shape as `xeonsd generate` flags, for a run whose family has no export.

The settings are the role's variables without their prefix: batch_size, num_images_per_prompt, height and width
(the static shape; auto: resolution, the one the run trained at), weight_format (auto, fp32, fp16 or int8; auto is xeonsd export's own
default: int8 with quantize, else fp32), quantize ("" or none: no quantization, xeonsd's default; hybrid or
hybrid-compact), calibration_samples ("": xeonsd's default), tome (0 to 0.75) and tome_mlp.

The key names every setting that changes the exported model, so a later run on the same base model reuses an export
only when it was made with the same settings: ``<fingerprint>-<batch>x<images per prompt>-<width>x<height>-<weight
format>``, then ``-<quantize>`` and ``-cal<samples>`` when quantized (the samples only when set), ``-tome<ratio>``
when merging tokens and ``-mlp`` with tome_mlp. Settings at their defaults add nothing: the exports kept before a
setting existed keep their name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

WEIGHT_FORMATS = ("fp32", "fp16", "int8")
NO_QUANTIZE = ("", "none")


class ExportSettingsError(ValueError):
    """Settings that xeonsd export would refuse, said with the role's variable to fix."""


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("true", "yes", "on", "1")


def _ratio(value: Any) -> str:
    """The token merging ratio as the key and the flag write it (0.5, not 0.50 or 5e-01)."""
    try:
        ratio = float(value)
    except (TypeError, ValueError):
        raise ExportSettingsError(f"openvino_export_tome is {value!r}: set it to a number in [0, 0.75]") from None
    return f"{ratio:g}"


def settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """The settings checked and resolved (weight_format auto made concrete, quantize none made "")."""
    s = dict(values)
    s["quantize"] = "" if s.get("quantize") is None or str(s["quantize"]) in NO_QUANTIZE else str(s["quantize"])
    fmt = str(s.get("weight_format") or "auto")
    if fmt == "auto":
        fmt = "int8" if s["quantize"] else "fp32"
    if fmt not in WEIGHT_FORMATS:
        raise ExportSettingsError(f"openvino_export_weight_format is {fmt!r}: choose auto, {', '.join(WEIGHT_FORMATS)}")
    if s["quantize"] and fmt != "int8":
        raise ExportSettingsError(
            f"openvino_export_quantize {s['quantize']} stores 8-bit weights, openvino_export_weight_format is {fmt}. "
            "Fix: set openvino_export_weight_format to auto (or int8)."
        )
    s["weight_format"] = fmt
    for side in ("height", "width"):
        if str(s[side]) == "auto":
            if not str(s.get("resolution") or ""):
                raise ExportSettingsError(
                    f"openvino_export_{side} is auto but the run recorded no resolution. Fix: set "
                    f"openvino_export_{side} to the size the run trained at, e.g. 512."
                )
            s[side] = s["resolution"]
    samples = str(s.get("calibration_samples") or "")
    if samples and not s["quantize"]:
        raise ExportSettingsError(
            "openvino_export_calibration_samples is set but openvino_export_quantize is none: calibration is part "
            "of the quantization. Fix: set openvino_export_quantize (hybrid or hybrid-compact), or leave the "
            "samples empty."
        )
    s["calibration_samples"] = samples
    s["tome"] = _ratio(s.get("tome", 0))
    s["tome_mlp"] = _truthy(s.get("tome_mlp", False))
    if s["tome_mlp"] and float(s["tome"]) == 0:
        raise ExportSettingsError(
            "openvino_export_tome_mlp merges tokens before the feed-forward too, but openvino_export_tome is 0. "
            "Fix: set openvino_export_tome above 0 (e.g. 0.5), or openvino_export_tome_mlp to false."
        )
    return s


def export_args(values: Mapping[str, Any]) -> list[str]:
    """The `xeonsd export SRC OUT` flags of the settings."""
    s = settings(values)
    # a table: one flag and its value a line (ruff would put one item per line)
    args = [
        "--batch-size", str(s["batch_size"]),
        "--num-images-per-prompt", str(s["num_images_per_prompt"]),
        "--height", str(s["height"]),
        "--width", str(s["width"]),
        "--weight-format", s["weight_format"],
    ]  # fmt: skip
    if s["quantize"]:
        args += ["--quantize", s["quantize"]]
    if s["calibration_samples"]:
        args += ["--calibration-samples", s["calibration_samples"]]
    args += ["--tome", s["tome"]]
    if s["tome_mlp"]:
        args.append("--tome-mlp")
    return args


def generate_shape_args(values: Mapping[str, Any]) -> list[str]:
    """The `xeonsd generate` flags that give a run made without an export (the PyTorch engine) the calls and size
    the export's static shape would have had: images per call, height and width."""
    s = settings(values)
    per_call = int(s["batch_size"]) * int(s["num_images_per_prompt"])
    return ["--batch-size", str(per_call), "--height", str(s["height"]), "--width", str(s["width"])]


def export_key(values: Mapping[str, Any], fingerprint: str) -> str:
    """The directory name of the base model's export with these settings (see the module's docstring)."""
    s = settings(values)
    key = (
        f"{fingerprint}-{s['batch_size']}x{s['num_images_per_prompt']}-{s['width']}x{s['height']}-{s['weight_format']}"
    )
    if s["quantize"]:
        key += f"-{s['quantize']}"
        if s["calibration_samples"]:
            key += f"-cal{s['calibration_samples']}"
    if float(s["tome"]) > 0:
        key += f"-tome{s['tome']}" + ("-mlp" if s["tome_mlp"] else "")
    return key


class FilterModule:
    def filters(self) -> dict:
        return {
            "xeonsd_export_args": export_args,
            "xeonsd_export_key": export_key,
            "xeonsd_generate_shape_args": generate_shape_args,
        }
