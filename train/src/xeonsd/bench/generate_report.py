"""What ``xeonsd bench generate`` measures beside the timings, and the table it prints.

The FLOPs of one image (counted with ``torch.utils.flop_counter`` on the pipeline's own networks), and the table:
seconds per image (the median of the interleaved rounds, with their min-max), the ratio to (a) (the median of each
round's ratio), the FLOP floor of (d) at this CPU's matmul peaks (measured as ``bench train`` measures them:
:func:`xeonsd.bench.rounds.probes`), and each target judged where it applies.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from xeonsd.bench.generate_flow import flops_line, flops_of, flow_family, flow_pipeline_flops
from xeonsd.bench.rounds import range_text

TARGET_SPEEDUP_D = 6.0
TARGET_FLOOR_RATIO_D = 1.25
TARGET_SPEEDUP_G_OVER_D = 1.4  # on AMX-INT8
TARGET_SPEEDUP_I_OVER_D = 1.8  # on AMX, at 512 px
TARGET_SIZE_I = 512


def pipeline_flops(model: Path, height: int, width: int, steps: int) -> dict[str, float]:
    """FLOPs of one image: text encoder (prompt + negative), ``steps`` x UNet at batch 2, VAE decoder; for FLUX.1
    and SD3 the text encoders, ``steps`` x the transformer and the VAE decoder (:mod:`xeonsd.bench.generate_flow`)."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    flow = flow_family(model)
    if flow is not None:
        return flow_pipeline_flops(model, flow.spec, height, width, steps)
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(model / "unet"))
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(model / "vae"))
        text = CLIPTextModel(CLIPTextConfig.from_pretrained(model / "text_encoder"))
        text2 = None
        if (model / "text_encoder_2").is_dir():  # SDXL: its second encoder's hidden states are concatenated
            from transformers import CLIPTextModelWithProjection

            text2 = CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(model / "text_encoder_2"))

    h, w, hidden = height // 8, width // 8, text.config.hidden_size
    encoders = [text]
    if text2 is not None:  # SDXL: the pooled output of the second encoder and the six micro-conditioning numbers
        hidden += text2.config.hidden_size
        encoders.append(text2)

    def extra() -> dict[str, Any]:  # made inside ``flops_of``, on the meta device
        if text2 is None:
            return {}
        pooled = torch.randn(2, text2.config.projection_dim)
        return {"added_cond_kwargs": {"text_embeds": pooled, "time_ids": torch.randn(2, 6)}}

    unet_call = flops_of(lambda: unet(torch.randn(2, 4, h, w), torch.tensor(1), torch.randn(2, 77, hidden), **extra()))
    out = {
        "text_encoder": sum(flops_of(lambda e=e: e(torch.zeros(2, 77, dtype=torch.long))) for e in encoders),
        "unet": steps * unet_call,
        "vae_decoder": flops_of(lambda: vae.decode(torch.randn(1, 4, h, w))),
    }
    out["total"] = sum(out.values())
    return out


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(report: dict[str, Any]) -> str:
    by_key = {r["key"]: r for r in report["results"]}
    base = by_key.get("a", {}).get("per_image_s")
    steps = report["steps"]
    lines = [
        f"xeonsd bench generate: {report['model']}, {report['width']}x{report['height']}, {steps} steps, "
        f"{report['images']} image(s) per variant, seed {report['seed']}, warm-up {report['warmup']}",
    ]
    if report.get("rounds"):
        lines.append(
            f"{report['rounds']} interleaved round(s) of the variants; s/image: median of the rounds (min-max); "
            "vs (a): median of each round's (a) / variant (min-max); peak RSS: this process's while the variant "
            "loaded and ran (one pipeline in memory at a time), median of the rounds"
        )
    lines.append(
        f"{'variant':<40} {'load+compile s':>14} {'s/image':>9} {'min-max':>13} {'s/step':>8} {'vs (a)':>8} "
        f"{'min-max':>11} {'peak RSS GB':>12}"
    )
    for r in report["results"]:
        label = f"({r['key']}) {r['name']}"
        if r["per_image_s"] is None:
            lines.append(f"{label:<40} {r['note']}")
            continue
        vs_a, spread = r.get("vs_a"), r.get("per_image_spread")
        ratio = f"{vs_a['median']:.2f}x" if vs_a else (f"{base / r['per_image_s']:.2f}x" if base else "-")
        lines.append(
            f"{label:<40} {r['load_s']:>14.1f} {r['per_image_s']:>9.2f} {range_text(spread) if spread else '-':>13} "
            f"{r['per_image_s'] / steps:>8.2f} {ratio:>8} {range_text(vs_a) if vs_a else '-':>11} "
            f"{_gb(r.get('peak_rss_gb')):>12}"
        )
    f = report["flops_per_image"]
    peaks = report["matmul_peak_flops"]
    lines.append(
        flops_line(report)
        if "transformer" in f
        else f"FLOPs per image: {f['total'] / 1e12:.2f} TFLOP (UNet {f['unet'] / 1e12:.2f} = {steps} x batch 2, "
        f"text encoder {f['text_encoder'] / 1e12:.3f}, VAE decoder {f['vae_decoder'] / 1e12:.3f})"
    )
    lines.append(
        f"matmul peak measured now: bf16 {peaks['bf16'] / 1e12:.4f} TFLOP/s, fp32 {peaks['fp32'] / 1e12:.3f} TFLOP/s; "
        f"OpenVINO CPU inference precision here: {report['openvino_cpu_precision']}"
    )
    # The floor is taken at the bf16 peak, as asked; where this CPU has no native bf16 (the bf16 "peak" is an
    # emulation far below fp32) OpenVINO runs in f32, and the fp32 peak is the floor that means something.
    native_bf16 = peaks["bf16"] >= peaks["fp32"]
    floor_bf16, floor_fp32 = f["total"] / peaks["bf16"], f["total"] / peaks["fp32"]
    d = by_key.get("d", {}).get("per_image_s")
    e = by_key.get("e", {}).get("per_image_s")
    line = f"FLOP floor of (d): {floor_bf16:.2f} s/image at the bf16 peak, {floor_fp32:.2f} s/image at the fp32 peak"
    if d:
        line += f"; (d) is {d / floor_bf16:.2f}x the bf16 floor, {d / floor_fp32:.2f}x the fp32 floor"
    lines.append(line)
    if d and base:
        vs_a = by_key["d"].get("vs_a")
        speedup = vs_a["median"] if vs_a else base / d
        verdict = [
            f"(d) >= {TARGET_SPEEDUP_D:.0f}x faster than (a): {speedup:.2f}x ({_met(speedup >= TARGET_SPEEDUP_D)})"
        ]
        if native_bf16:
            ratio = d / floor_bf16
            verdict.append(
                f"(d) within {TARGET_FLOOR_RATIO_D}x of the bf16 floor: {ratio:.2f}x "
                f"({_met(ratio <= TARGET_FLOOR_RATIO_D)})"
            )
        else:
            ratio = d / floor_fp32
            verdict.append(
                f"(d) within {TARGET_FLOOR_RATIO_D}x of the bf16 floor: n/a, no native bf16 here "
                f"(vs the fp32 floor: {ratio:.2f}x, {_met(ratio <= TARGET_FLOOR_RATIO_D)})"
            )
        if e:
            verdict.append(f"(e) faster than (d): {e:.2f} vs {d:.2f} s ({_met(e < d)})")
        lines.append("targets: " + "; ".join(verdict))
    lines.extend(_beside_d(report, by_key))
    if report["export_seconds"]:
        lines.append("export time (s, cached between runs): " + json.dumps(report["export_seconds"]))
    return "\n".join(lines)


def _beside_d(report: dict[str, Any], by_key: dict[str, Any]) -> list[str]:
    """The lines of the variants measured beside (d): (g) hybrid int8, (h) and (i) token merging, (j) the PyTorch
    engine (each where it ran)."""
    lines = [_hybrid_line(report, by_key), *_tome_lines(report), _torch_engine_line(report, by_key)]
    return [line for line in lines if line]


def _hybrid_line(report: dict[str, Any], by_key: dict[str, Any]) -> str | None:
    """(g) beside (d): speed ratio, pixel difference for the same seed, and the AMX target where it applies."""
    d = by_key.get("d", {}).get("per_image_s")
    g = by_key.get("g", {}).get("per_image_s")
    if not (d and g):
        return None
    rounds = report.get("g_over_d")
    speedup = rounds["speedup"]["median"] if rounds else d / g  # the median of each round's d/g
    line = f"(g) hybrid int8 beside (d) static: time g/d {1 / speedup:.2f} = {_faster(speedup)}"
    if rounds:
        line += f" (per round {range_text(rounds['speedup'])}x)"
    line += _pixel_difference(report.get("g_vs_d") or {})
    cpu = report.get("cpu") or {}
    int8 = cpu.get("native_int8")
    target = f"(g) >= {TARGET_SPEEDUP_G_OVER_D}x faster than (d)"
    if int8 == "AMX-INT8":
        line += f"; target {target}: {speedup:.2f}x ({_met(speedup >= TARGET_SPEEDUP_G_OVER_D)})"
    elif int8:
        line += f"; target {target} is for AMX-INT8: not judged, this CPU ({cpu.get('model')}) has {int8} only"
    else:
        line += (
            f"; target {target} is for AMX-INT8: not judged, this CPU ({cpu.get('model', 'unknown')}) has no "
            "AMX-INT8 and no VNNI (no amx_int8, avx512_vnni or avx_vnni in /proc/cpuinfo)"
        )
    return line


def _tome_lines(report: dict[str, Any]) -> list[str]:
    """(h) ToMe and (i) ToMe + hybrid beside (d): each round's d/variant, the pixel difference for the same seed,
    and the target of (i), judged only on AMX at 512 px."""
    lines = []
    names = {"h": "ToMe", "i": "ToMe + hybrid int8"}
    for key, cmp in (report.get("tome_vs_d") or {}).items():
        speedup = cmp["speedup"]["median"]
        line = (
            f"({key}) {names[key]} {report['tome_ratio']:g} beside (d) static: {_faster(speedup)} "
            f"(per round {', '.join(f'{r:.2f}' for r in cmp['speedup_rounds'])}){_pixel_difference(cmp)}"
        )
        if key == "i":
            line += "; " + _tome_target(report, speedup)
        lines.append(line)
    return lines


def _torch_engine_line(report: dict[str, Any], by_key: dict[str, Any]) -> str | None:
    """(j) the PyTorch engine beside (d) OpenVINO static: each round's d/j and the pixel difference for the same
    seed (what serving a family without an OpenVINO export, or with --engine torch, costs)."""
    cmp = report.get("torch_engine_vs_d")
    if not cmp or "j" not in by_key:
        return None
    speedup = cmp["speedup"]["median"]
    j, d = by_key["j"].get("peak_rss_gb"), by_key.get("d", {}).get("peak_rss_gb")
    memory = f"; peak RSS {j:.2f} GB against {d:.2f} GB" if j is not None and d is not None else ""
    return (
        f"(j) {by_key['j']['name']} beside (d) OpenVINO static: time j/d {1 / speedup:.2f} = {_faster(speedup)} "
        f"(per round {', '.join(f'{r:.2f}' for r in cmp['speedup_rounds'])}){_pixel_difference(cmp)}{memory}"
    )


def _tome_target(report: dict[str, Any], speedup: float) -> str:
    cpu = report.get("cpu") or {}
    target = f"target (i) >= {TARGET_SPEEDUP_I_OVER_D}x faster than (d) at {TARGET_SIZE_I} px"
    if not cpu.get("amx"):
        return f"{target} is for AMX: not judged, this CPU ({cpu.get('model', 'unknown')}) has no AMX"
    if (report["height"], report["width"]) != (TARGET_SIZE_I, TARGET_SIZE_I):
        return f"{target}: not judged at {report['width']}x{report['height']}"
    return f"{target}: {speedup:.2f}x ({_met(speedup >= TARGET_SPEEDUP_I_OVER_D)})"


def _faster(speedup: float) -> str:
    return f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"


def _pixel_difference(cmp: dict[str, Any]) -> str:
    """How a variant's image differs from (d)'s for the same seed, where that was measured ("" where not)."""
    if "mean_abs_pixel_diff" not in cmp:
        return ""
    diff = cmp["mean_abs_pixel_diff"]
    return f"; mean absolute pixel difference to (d)'s image (seed {cmp['seed']}): {diff:.2f} / 255"


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"
