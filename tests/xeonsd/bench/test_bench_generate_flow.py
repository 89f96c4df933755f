"""``xeonsd bench generate`` on the flow-matching families (FLUX.1, SD3): the plain model (no concept), the variants
that apply, the ones ``xeonsd export`` refuses skipped with its reason, and the FLOP count of the transformer
pipeline (classifier-free guidance: two transformer calls' worth per step on SD3, one on FLUX.1-dev)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from xeonsd import cli
from xeonsd.bench.generate import main
from xeonsd.bench.generate_flow import PLAIN_PROMPT, transformer_call_flops
from xeonsd.bench.generate_report import pipeline_flops
from xeonsd.families import by_name


def test_bench_generate_runs_tiny_flux_end_to_end_and_skips_what_the_export_refuses(tmp_path: Path, capsys) -> None:
    """(a) diffusers, (d) OpenVINO static, (f) GenAI and (j) the PyTorch engine run on the plain tiny-flux at its own
    64 px, (j) printed beside (d) with the ratio and the pixel difference of the same seed's image; (g) hybrid int8
    and (h) ToMe are skipped, each in one line with the export's reason, and the run goes on."""
    work = tmp_path / "work"
    argv = ["bench", "generate", "--arch", "tiny-flux", "--only", "adfghj", "--steps", "2", "--rounds", "1"]
    argv += ["--probes", "1", "--peak-size", "256", "--probe-seconds", "0.05"]  # quick probes: not checked here
    assert cli.main([*argv, "--workdir", str(work)]) == 0
    out = capsys.readouterr().out
    report = json.loads((work / "bench-generate-64x64-2steps.json").read_text())
    rows = {r["key"]: r for r in report["results"]}
    assert sorted(rows) == list("adfghj")
    for key in "adfj":
        assert rows[key]["per_image_s"] > 0 and rows[key]["load_s"] > 0 and rows[key]["note"] == "", rows[key]
        # the process's resident memory while the variant loaded and ran: torch and a pipeline at least
        assert 0.1 < rows[key]["peak_rss_gb"] < 64, rows[key]
    reasons = {"g": "hybrid int8 calibrates a UNet's calls", "h": "token merging patches a UNet's transformer blocks"}
    for key, reason in reasons.items():
        note = rows[key]["note"]
        assert rows[key]["per_image_s"] is None and note.startswith("skipped: --") and reason in note, note
        assert sum(line.startswith(f"({key}) ") and line.endswith(note) for line in out.splitlines()) == 2  # + table
    j = report["torch_engine_vs_d"]
    assert j["speedup"]["median"] > 0 and len(j["speedup_rounds"]) == 1 and 0 <= j["mean_abs_pixel_diff"] < 255, j
    assert rows["j"]["name"].startswith("PyTorch engine") and rows["j"]["name"].endswith("(--engine torch)")
    j_line = next(line for line in out.splitlines() if line.startswith("(j) PyTorch engine") and "beside" in line)
    assert "beside (d) OpenVINO static: time j/d" in j_line and "mean absolute pixel difference" in j_line, j_line
    assert f"peak RSS {rows['j']['peak_rss_gb']:.2f} GB against {rows['d']['peak_rss_gb']:.2f} GB" in j_line, j_line
    assert (report["family"], report["concept"], report["prompt"]) == ("flux", None, PLAIN_PROMPT)
    assert report["transformer_calls_per_step"] == 1  # FLUX.1-dev: guidance embedding, no classifier-free guidance
    assert not list(work.glob("concept-*"))
    manifest = json.loads((work / "ov-static-64x64-fp32" / "xeonsd_export.json").read_text())
    assert manifest["family"] == "flux" and manifest["embeds"] is None
    assert "= 2 x 1 call, no classifier-free guidance" in out
    flops = report["flops_per_image"]
    assert min(flops.values()) > 0 and flops["total"] == pytest.approx(sum(v for k, v in flops.items() if k != "total"))
    more = pipeline_flops(work / "model-tiny-flux", 64, 64, steps=5)
    assert more["transformer"] == pytest.approx(2.5 * flops["transformer"]) and more["total"] > flops["total"]
    assert more["text_encoder"] == flops["text_encoder"] and more["vae_decoder"] == flops["vae_decoder"]


def test_sd3_flops_count_two_transformer_calls_per_step_flux_one(tiny_sd3_model: Path, tiny_flux_model: Path) -> None:
    """SD3 runs classifier-free guidance (prompt and negative prompt: batch 2); FLUX.1-dev does not."""
    for model, name, calls in ((tiny_sd3_model, "sd3", 2), (tiny_flux_model, "flux", 1)):
        family = by_name(name)
        one_call = transformer_call_flops(model, family, 64, 64, batch=1)
        flops = pipeline_flops(model, 64, 64, steps=3)
        assert one_call > 0 and flops["transformer"] == pytest.approx(3 * calls * one_call), name
        bigger = transformer_call_flops(model, family, 128, 128, batch=1)
        assert bigger > one_call  # 4x the image tokens (beside the same 109 text tokens)


def test_bench_generate_offers_every_make_tiny_model_arch_and_depth_only_on_full_transformers(
    tmp_path: Path, monkeypatch
) -> None:
    from xeonsd.assets.models import arch_names, arch_resolution
    from xeonsd.bench.generate import build_parser
    from xeonsd.bench.generate_pipelines import model_dir

    assert next(a for a in build_parser()._actions if a.dest == "arch").choices == arch_names()
    sizes = {arch: arch_resolution(arch) for arch in arch_names()}
    assert sizes["sd15"] == 512 and sizes["sd21"] == 768 and sizes["sdxl"] == sizes["qwenimage"] == 1024
    assert sizes["flux"] == sizes["sd35m"] == 1024 and sizes["tiny-sd3"] == sizes["tiny-flux2"] == 64
    monkeypatch.chdir(tmp_path)
    for flags, said in (
        (
            ["--arch", "sd15", "--depth", "2"],
            "--depth applies to --arch flux or flux2-klein or zimage or qwenimage or flux-kontext or qwenimage-edit or krea2 or flux2-dev only, not to --arch sd15",
        ),
        (["--arch", "flux", "--depth", "0"], "--depth must be at least 1, got 0"),
        (
            ["--model", str(tmp_path), "--depth", "2"],
            f"--depth applies to --arch flux or flux2-klein or zimage or qwenimage or flux-kontext or qwenimage-edit or krea2 or flux2-dev only, not to --model {tmp_path}",
        ),
    ):
        with pytest.raises(SystemExit, match=re.escape(f"xeonsd bench generate: error: {said}")):
            main(["--workdir", "work", "--quick", *flags])
    assert list(tmp_path.iterdir()) == []
    depth = model_dir(argparse.Namespace(model=None, arch="flux", depth=2), Path("w"))
    assert (
        depth
        == Path("w/model-flux-depth2")
        != model_dir(argparse.Namespace(model=None, arch="flux", depth=3), Path("w"))
    )
    assert model_dir(argparse.Namespace(model=None, arch="flux", depth=None), Path("w")) == Path("w/model-flux")
