"""The pieces of ``xeonsd bench generate`` that can be checked without the full-size run: FLOPs and the report."""

from __future__ import annotations

from pathlib import Path

import pytest

from xeonsd.bench.generate import main
from xeonsd.bench.generate_report import format_table, pipeline_flops


def test_pipeline_flops_count_every_unet_step_and_scale_with_pixels(tiny_model: Path) -> None:
    one = pipeline_flops(tiny_model, 64, 64, steps=1)
    ten = pipeline_flops(tiny_model, 64, 64, steps=10)
    big = pipeline_flops(tiny_model, 128, 128, steps=1)
    assert min(one.values()) > 0
    assert ten["unet"] == pytest.approx(10 * one["unet"])
    assert ten["text_encoder"] == one["text_encoder"] and ten["vae_decoder"] == one["vae_decoder"]
    assert ten["total"] == pytest.approx(ten["unet"] + ten["text_encoder"] + ten["vae_decoder"])
    # Convolutions dominate: 4x the pixels is at least ~4x the UNet and decoder work (attention grows faster).
    assert big["unet"] >= 3.9 * one["unet"] and big["vae_decoder"] >= 3.9 * one["vae_decoder"]


def _report(per_image: dict[str, float], bf16: float, fp32: float) -> dict:
    results = [{"key": k, "name": k, "load_s": 1.0, "per_image_s": v, "note": ""} for k, v in per_image.items()]
    return {
        "model": "m",
        "height": 512,
        "width": 512,
        "steps": 20,
        "images": 1,
        "seed": 0,
        "warmup": False,
        "results": results,
        "flops_per_image": {"total": 35e12, "unet": 32e12, "text_encoder": 0.1e12, "vae_decoder": 2.9e12},
        "matmul_peak_flops": {"bf16": bf16, "fp32": fp32},
        "openvino_cpu_precision": "bf16",
        "export_seconds": {},
    }


def test_report_gives_ratios_to_a_and_judges_the_targets() -> None:
    table = format_table(_report({"a": 260.0, "d": 40.0, "e": 35.0}, bf16=1e12, fp32=0.25e12))
    assert "6.50x" in table  # (a) / (d)
    assert "(d) >= 6x faster than (a): 6.50x (met)" in table
    assert "(d) within 1.25x of the bf16 floor: 1.14x (met)" in table  # 40 s vs 35 TFLOP / 1 TFLOP/s
    assert "(e) faster than (d): 35.00 vs 40.00 s (met)" in table
    slow = format_table(_report({"a": 260.0, "d": 100.0, "e": 120.0}, bf16=1e12, fp32=0.25e12))
    assert (
        "2.60x (NOT met)" in slow
        and "2.86x (NOT met)" in slow
        and "(e) faster than (d): 120.00 vs 100.00 s (NOT met)" in slow
    )


def test_report_does_not_judge_against_an_emulated_bf16_peak() -> None:
    table = format_table(_report({"a": 300.0, "d": 330.0}, bf16=0.0002e12, fp32=0.11e12))
    assert "n/a, no native bf16 here (vs the fp32 floor: 1.04x, met)" in table


def test_bench_generate_refuses_a_model_directory_that_does_not_exist(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["--model", "owner/typo", "--workdir", "work", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xeonsd bench generate: error: --model owner/typo: cannot be loaded: ")
    assert list(tmp_path.iterdir()) == []  # no random-weight model built under the mistyped name


def _with_g(cpu_int8: str | None) -> dict:
    report = _report({"d": 55.0, "g": 36.0}, bf16=2e12, fp32=0.5e12)
    report["g_vs_d"] = {"mean_abs_pixel_diff": 4.25, "seed": 0}
    report["cpu"] = {"model": "Some CPU", "native_int8": cpu_int8}
    return report


def test_report_puts_g_beside_d_and_judges_its_target_only_with_amx_int8() -> None:
    amx = format_table(_with_g("AMX-INT8"))
    line = "(g) hybrid int8 beside (d) static: time g/d 0.65 = 1.53x faster"
    assert line in amx and "pixel difference to (d)'s image (seed 0): 4.25 / 255" in amx
    assert "target (g) >= 1.4x faster than (d): 1.53x (met)" in amx
    slow = _with_g("AMX-INT8")
    slow["results"][1]["per_image_s"] = 50.0
    assert "1.10x (NOT met)" in format_table(slow)
    slow["results"][1]["per_image_s"] = 110.0
    assert "time g/d 2.00 = 2.00x slower" in format_table(slow)
    none = format_table(_with_g(None))
    assert "not judged, this CPU (Some CPU) has no AMX-INT8 and no VNNI" in none and "(met)" not in none
    assert "not judged, this CPU (Some CPU) has AVX512-VNNI only" in format_table(_with_g("AVX512-VNNI"))


def test_report_reads_the_ratios_round_by_round() -> None:
    """(a) and (d) measured in two interleaved rounds while the machine slowed down: the ratio is the median of
    each round's a/d (5x and 8x: 6.5x), not the ratio of the medians (300 / 45 = 6.67x)."""
    report = _report({"a": 300.0, "d": 45.0, "g": 30.0}, bf16=1e12, fp32=0.25e12)
    rows = {r["key"]: r for r in report["results"]}
    rows["a"].update(per_image_spread={"min": 200.0, "max": 400.0}, vs_a={"median": 1.0, "min": 1.0, "max": 1.0})
    rows["d"].update(per_image_spread={"min": 40.0, "max": 50.0}, vs_a={"median": 6.5, "min": 5.0, "max": 8.0})
    report["rounds"] = 2
    report["g_over_d"] = {"speedup_rounds": [1.25, 1.75], "speedup": {"median": 1.5, "min": 1.25, "max": 1.75}}
    report["cpu"] = {"model": "Some CPU", "native_int8": "AMX-INT8"}
    table = format_table(report)
    assert "2 interleaved round(s) of the variants" in table
    line_d = next(ln for ln in table.splitlines() if ln.startswith("(d)"))
    assert "40.00-50.00" in line_d and "6.50x" in line_d and "5.00-8.00" in line_d
    assert "(d) >= 6x faster than (a): 6.50x (met)" in table
    assert "time g/d 0.67 = 1.50x faster (per round 1.25-1.75x)" in table
    assert "target (g) >= 1.4x faster than (d): 1.50x (met)" in table


def test_bench_generate_runs_its_variants_interleaved_round_by_round() -> None:
    """a d g a d g: each planned variant once per round; recorded (load, s/image) pairs, nothing timed."""
    import argparse

    from xeonsd.bench.generate_pipelines import Bench

    calls: list[str] = []
    recorded = {"a": [(1.0, 200.0), (1.0, 400.0)], "d": [(2.0, 40.0), (4.0, 50.0)], "g": [(3.0, 30.0), (3.0, 25.0)]}

    def variant(key: str):
        return lambda: (calls.append(key), recorded[key][calls.count(key) - 1])[1]

    bench = Bench(argparse.Namespace(only=["a", "d", "g"]), Path("m"), Path("e"), Path("w"))
    for key in "gad":  # run in the order they were planned, round after round
        bench.measure(key, f"variant {key}", variant(key))
    bench.measure("e", "not asked for", variant("e"))
    bench.measure_rounds(2)
    assert calls == ["g", "a", "d", "g", "a", "d"]
    rows = {r.key: r for r in bench.results}
    assert [r.key for r in bench.results] == ["a", "d", "g"]
    assert rows["d"].rounds_s == [40.0, 50.0] and rows["d"].per_image_s == 45.0 and rows["d"].load_s == 3.0
    assert rows["d"].vs_a_rounds == [5.0, 8.0] and rows["d"].vs_a["median"] == 6.5
    assert rows["g"].per_image_spread["min"] == 25.0 and rows["g"].per_image_spread["max"] == 30.0


def _with_tome(amx: bool, size: int = 512) -> dict:
    report = _report({"d": 60.0, "h": 40.0, "i": 30.0}, bf16=2e12, fp32=0.5e12)
    report["height"] = report["width"] = size
    report["tome_ratio"] = 0.5
    report["tome_vs_d"] = {
        "h": {"speedup_rounds": [1.4, 1.6], "speedup": {"median": 1.5}, "mean_abs_pixel_diff": 3.5, "seed": 0},
        "i": {"speedup_rounds": [1.9, 2.1], "speedup": {"median": 2.0}, "mean_abs_pixel_diff": 5.25, "seed": 0},
    }
    report["cpu"] = {"model": "Some CPU", "native_int8": "AMX-INT8" if amx else None, "amx": amx}
    return report


def test_report_puts_tome_beside_d_and_judges_i_only_on_amx_at_512() -> None:
    amx = format_table(_with_tome(amx=True))
    assert "(h) ToMe 0.5 beside (d) static: 1.50x faster (per round 1.40, 1.60); mean absolute pixel" in amx
    assert "(d)'s image (seed 0): 3.50 / 255" in amx and "(seed 0): 5.25 / 255" in amx
    assert "target (i) >= 1.8x faster than (d) at 512 px: 2.00x (met)" in amx
    assert "(h) ToMe 0.5 beside (d) static: 1.50x faster" in amx and amx.count("target (i)") == 1
    none = format_table(_with_tome(amx=False))
    assert "(i) ToMe + hybrid int8 0.5 beside (d) static: 2.00x faster" in none
    assert "target (i) >= 1.8x faster than (d) at 512 px is for AMX: not judged, this CPU (Some CPU) has no AMX" in none
    assert "not judged at 256x256" in format_table(_with_tome(amx=True, size=256))


@pytest.mark.parametrize("flags", [["--tome", "0.9"], ["--tome", "x"], ["--tome", "0", "--only", "h"]])
def test_bench_generate_refuses_a_bad_tome_ratio(tmp_path: Path, monkeypatch, flags: list[str]) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="xeonsd bench generate: error: .*--tome"):
        main(["--workdir", "work", "--quick", *flags])
    assert list(tmp_path.iterdir()) == []
