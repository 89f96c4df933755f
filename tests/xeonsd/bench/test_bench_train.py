"""The training benchmark really switches each optimisation off (figures are printed, never asserted on time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runs import run_cli


def test_bench_train_variants_differ_in_what_they_switch_off(tiny_model, tmp_path, cli_env):
    out = tmp_path / "bench.json"
    args = ["bench", "train", f"--model={tiny_model}", "--resolution=64", "--steps=2", "--warmup=1"]
    args += ["--peak-size=512", "--dtype=fp32", f"--json={out}", "--no-ranks2", "--rounds=2", "--probes=2"]
    args += ["--probe-seconds=0.05"]  # each size still gets 3 products: the peak's range is what is checked
    # The variants whose differences are checked (the precision one's is only that it runs: the interleaving test)
    args += ["--only", "optimized", "per-step VAE encode", "whole-matrix embedding"]
    proc = run_cli(args, cli_env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    report = json.loads(out.read_text())
    rows = {r["variant"]: r for r in report["results"]}
    assert set(rows) == {"optimized", "per-step VAE encode", "whole-matrix embedding"}
    hidden, vocab = 32, 667  # tiny text encoder; 666 tokens + the placeholder
    assert rows["optimized"]["allreduce_bytes"] == (hidden + 1) * 4
    assert rows["whole-matrix embedding"]["allreduce_bytes"] == (vocab * hidden + 1) * 4
    # Encoding every step adds the VAE encoder's FLOPs to each step.
    assert rows["per-step VAE encode"]["tflop_per_step"] > rows["optimized"]["tflop_per_step"] * 1.05
    for r in rows.values():
        assert r["s_per_step"] > 0 and r["peak_rss_gb"] > 0
        # The trainer's own estimate beside the measured peak (its memory_estimate.json).
        assert 0 < r["estimate_training_gb"] < 2 * r["peak_rss_gb"] and r["estimate_loading_gb"] > 0, r
    assert "est. train" in proc.stdout and "est. load" in proc.stdout
    # The peaks and the shares are in TFLOP/s and fractions: a CPU core does 0.01-10 TFLOP/s fp32, and the
    # optimized run reaches a measurable share of it (a FLOP/s peak against TFLOP/step reads 0.0 %).
    assert 0.005 < report["peak_tflops"]["fp32"] < 100, report["peak_tflops"]
    assert 1e-4 < rows["optimized"]["of_peak"] < 1.5, rows["optimized"]
    assert "x optimized" in proc.stdout and "matmul peak measured in this run" in proc.stdout
    # Interleaved: A B C A B C, each variant's rounds and its per-round ratio to the optimized run beside them.
    names = [r["variant"] for r in report["results"]]
    assert report["schedule"] == names + names
    for r in rows.values():
        assert len(r["s_per_step_rounds"]) == 2 and len(r["x_optimized_rounds"]) == 2
        assert r["s_per_step_spread"]["min"] <= r["s_per_step"] <= r["s_per_step_spread"]["max"]
    assert rows["optimized"]["x_optimized_rounds"] == [1.0, 1.0]
    probes = report["matmul_probes_flops"]
    assert [p["dtype"] for p in probes["before"]] == ["fp32", "bf16", "fp32", "bf16"] and len(probes["after"]) == 4
    last = proc.stdout.strip().splitlines()[-1]
    if report["machine"]["unstable"]:
        assert last == "machine unstable: read the ratios, not the seconds"
    else:
        assert last.endswith("machine steady")


def test_bench_train_refuses_a_model_it_cannot_find(tmp_path, capsys):
    from xeonsd.bench.train import main

    assert main([f"--model={tmp_path / 'nope'}", "--peak-size=64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"xeonsd bench train: error: --model {tmp_path / 'nope'}: cannot be loaded: looked for")


def test_bench_train_refuses_adapters_for_another_method(tiny_model, capsys):
    from xeonsd.bench.train import main

    assert main([f"--model={tiny_model}", "--method=full", "--adapters", "--peak-size=64"]) == 2
    assert "--adapters compares LoRA's adapter types: it needs --method lora, not full" in capsys.readouterr().err


def one_step_bench(
    out: Path, env: dict[str, str], *flags: str, only: tuple[str, ...] = ("optimized",)
) -> subprocess.CompletedProcess:
    """``xeonsd bench train FLAGS``: the ``only`` variants (the optimized one), one timed step at 64 px in fp32, one
    round and one probe, its report written to ``out``."""
    args = ["bench", "train", *flags, "--resolution=64", "--steps=1", "--peak-size=256", "--dtype=fp32"]
    args += ["--only", *only, f"--json={out}", "--rounds=1", "--probes=1", "--probe-seconds=0.05"]
    return run_cli(args, env, timeout=600)


def test_bench_train_lora_measures_the_allreduce_on_two_ranks_and_each_adapter_type(tiny_model, tmp_path, cli_env):
    """The 2-rank run's recorded collectives carry exactly the adapters' gradients and the loss. With --adapters,
    DoRA, LoKr and LoHa train beside plain LoRA, each row with its own trained parameters."""
    out = tmp_path / "bench.json"
    env = dict(cli_env, I_MPI_FABRICS="shm")
    flags = ("--method=lora", f"--model={tiny_model}", "--warmup=2", "--profile", "--adapters")
    proc = one_step_bench(out, env, *flags, only=("optimized", "dora", "lokr", "loha"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    trained = {r["variant"]: r["trainable_params"] for r in report["results"]}
    assert set(trained) == {"optimized", "dora", "lokr", "loha"} and all(n > 0 for n in trained.values()), trained
    # DoRA is LoRA and one magnitude per output feature of each adapted layer; LoKr and LoHa are shaped otherwise.
    assert trained["dora"] > trained["optimized"] and len(set(trained.values())) == 4, trained
    assert "trained params" in proc.stdout and f"{trained['lokr']:,}" in proc.stdout
    assert all(r["s_per_step"] > 0 for r in report["results"])
    computed = report["results"][0]["allreduce_bytes"]
    assert report["method"] == "lora" and computed > 1000
    assert report["allreduce_bytes_measured_2ranks"] == computed, report.get("allreduce_not_measured")
    assert "measured on a 2-rank mpirun run" in proc.stdout
    # --profile: the last warm-up step per class of work, adding up to the profiled step, FLOPs matmul-like only.
    prof = report["results"][0]["profile"]
    classes = {r["class"]: r for r in prof["classes"]}
    assert sum(r["seconds"] for r in classes.values()) == pytest.approx(prof["wall_s"], rel=0.05)
    assert classes["convolutions"]["tflop"] > 0 and classes["matmuls"]["of_peak"] > 0
    assert classes["optimizer"]["seconds"] > 0 and classes["optimizer"]["of_peak"] is None
    assert "one profiled step" in proc.stdout and "attention backward" in proc.stdout
    amx = next(t for t in report["targets"] if t["target"] == "amx_share_of_bf16_peak")
    assert amx["line"] in proc.stdout and (amx["met"] is None) == (
        "cannot be judged" in amx["line"] or "not judged" in amx["line"]
    )


def test_bench_train_runs_its_variants_interleaved_round_by_round(tmp_path, monkeypatch):
    """A B C A B C, each run in its own output directory; the runs are recorded, not timed."""
    import xeonsd.bench.train_runs as runner
    from xeonsd.bench.train_variants import variants_for

    calls = []

    def fake_run(variant, base_args, out, env):
        calls.append((variant.name, out.name))
        return {"rows": [{"s_per_step": 1.0, "allreduce_bytes": 4}], "peak_rss_gb": 1.0}

    monkeypatch.setattr(runner, "run_variant", fake_run)
    variants = list(variants_for("textual_inversion", "bf16"))[:3]
    runs = runner.run_rounds(variants, 2, [], tmp_path, {})
    names = [v.name for v in variants]
    assert [name for name, _ in calls] == names + names
    assert [out for _, out in calls] == ["v0r0", "v1r0", "v2r0", "v0r1", "v1r1", "v2r1"]
    assert list(runs) == names and all(len(r) == 2 for r in runs.values())


def test_bench_train_builds_an_edit_arch_trains_it_on_pairs_and_reports_its_family(tmp_path, cli_env):
    """``--arch tiny-qwenimage-edit``: the model is built once into the cache, the LoRA step is measured on image
    pairs (the family cannot train without a reference image: ``--pairs`` is its default), and the SD targets are not
    judged on it; textual inversion is refused there, and ``--pairs`` on a family without reference images, before
    anything runs."""
    out = tmp_path / "bench.json"
    env = dict(cli_env, XEONSD_CACHE=str(tmp_path / "cache"))
    proc = one_step_bench(out, env, "--arch=tiny-qwenimage-edit", "--method=lora", "--warmup=1", "--no-ranks2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["family"] == "qwenimage_edit" and report["model"] == str(tmp_path / "cache" / "tiny-qwenimage-edit")
    assert report["pairs"] is True
    assert report["results"][0]["tflop_per_step"] > 0 and report["results"][0]["peak_rss_gb"] > 0
    amx = next(t for t in report["targets"] if t["target"] == "amx_share_of_bf16_peak")
    assert amx["met"] is None and "set for SD 1.x/2.x and SDXL" in amx["line"]
    assert f"lora on {report['family_label']} (image pairs: a reference image each)" in proc.stdout, proc.stdout

    def refused(*flags: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "xeonsd.cli", "bench", "train", *flags],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 2, done.stdout + done.stderr
        return done.stderr

    said = refused("--arch=tiny-qwenimage-edit", "--method=textual_inversion")
    assert f"--method textual_inversion is not supported on {report['family_label']}" in said
    assert "--pairs: SD 1.x/2.x takes no reference image; leave out --pairs" in refused("--arch=tiny", "--pairs")


def test_bench_train_refuses_depth_on_an_arch_without_blocks_to_cut(capsys):
    from xeonsd.bench.train import main

    assert main(["--arch=sd15", "--depth=2", "--peak-size=64"]) == 2
    assert (
        "--depth applies to --arch flux or flux2-klein or zimage or qwenimage or flux-kontext or qwenimage-edit or krea2 or flux2-dev only, not to --arch sd15"
        in capsys.readouterr().err
    )
    assert main(["--arch=flux", "--depth=0", "--peak-size=64"]) == 2
    assert "--depth must be at least 1, got 0" in capsys.readouterr().err
    assert main(["--model=/nowhere", "--depth=2", "--peak-size=64"]) == 2  # a built model's depth is its own
    assert (
        "--depth applies to --arch flux or flux2-klein or zimage or qwenimage or flux-kontext or qwenimage-edit or krea2 or flux2-dev only, not to --model /nowhere"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize("method", ["lora", "full", "textual_inversion"])
def test_extra_variants_are_the_method_s_own(method):
    """``--extra`` adds the int8 frozen layers to LoRA only (a flag the other methods refuse), channels_last to the
    UNet families only; each variant runs ``xeonsd train`` with its flags (no command of its own)."""
    import argparse

    from xeonsd.bench.train import _variants
    from xeonsd.cpu import CpuInfo
    from xeonsd.families import Family, by_name

    args = argparse.Namespace(method=method, extra=True, only=None, reference_script=None, adapters=False)
    cpu = CpuInfo("test", frozenset({"avx512_bf16", "avx512_vnni"}))
    sd = {v.name: v for v in _variants(args, Family(by_name("sd"), 64, 8), cpu, "bf16")}
    flux = {v.name for v in _variants(args, Family(by_name("flux"), 64, 16), cpu, "bf16")}
    assert ("int8 base" in sd) == (method == "lora") and ("int8 base" in flux) == (method == "lora")
    assert not {"dora", "lokr", "loha"} & set(sd)  # only with --adapters
    assert ("random flip" in sd) == (method != "textual_inversion")  # textual inversion flips already
    assert "channels_last" in sd and "channels_last" not in flux
    assert all(not v.command for v in sd.values())
    if method == "lora":
        assert sd["int8 base"].flags == ("--base_precision=int8",)
