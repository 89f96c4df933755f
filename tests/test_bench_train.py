"""The training benchmark really switches each optimisation off (figures are printed, never asserted on time)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_train_variants_differ_in_what_they_switch_off(tiny_model, tmp_path, cli_env):
    out = tmp_path / "bench.json"
    args = ["bench", "train", f"--model={tiny_model}", "--resolution=64", "--steps=2", "--warmup=1"]
    args += ["--peak-size=512", "--dtype=fp32", f"--json={out}"]
    proc = subprocess.run([sys.executable, "-m", "xeonsd.cli", *args], env=cli_env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    report = json.loads(out.read_text())
    rows = {r["variant"]: r for r in report["results"]}
    assert set(rows) >= {"optimized", "per-step VAE encode", "whole-matrix embedding"}
    hidden, vocab = 32, 667  # tiny text encoder; 666 tokens + the placeholder
    assert rows["optimized"]["allreduce_bytes"] == (hidden + 1) * 4
    assert rows["whole-matrix embedding"]["allreduce_bytes"] == (vocab * hidden + 1) * 4
    # Encoding every step adds the VAE encoder's FLOPs to each step.
    assert rows["per-step VAE encode"]["tflop_per_step"] > rows["optimized"]["tflop_per_step"] * 1.05
    for r in rows.values():
        assert r["s_per_step"] > 0 and r["peak_rss_gb"] > 0
    assert "x optimized" in proc.stdout and "matmul peak measured in this run" in proc.stdout


def test_bench_train_refuses_a_model_it_cannot_find(tmp_path, capsys):
    from xeonsd.bench_train import main

    assert main([f"--model={tmp_path / 'nope'}", "--peak-size=64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"xeonsd bench train: error: --model {tmp_path / 'nope'}: cannot be loaded: looked for")
