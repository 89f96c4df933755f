"""``xeonsd bench attention``: through the CLI, at a tiny size, it prints the CPU, the fold it measures, both
variants' forward and backward with their share of the peak, and the ratio lines (figures printed, not asserted).
It runs as its own process: its FLOP count registers the flash kernels' formulas with torch's counter for the
process (xeonsd.flops.count_cpu_ops), which test_flops checks from the unregistered state."""

from __future__ import annotations

import re
import subprocess
import sys

TINY = ["--tokens=400", "--head-dim=8", "--threads=2", "--rounds=2", "--dtype=fp32", "--peak-size=256"]
TINY += ["--probe-seconds=0.01"]


def bench(env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "xeonsd.cli", "bench", "attention", *flags, *TINY]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_bench_attention_prints_both_variants_passes_and_the_speed_up(cli_env):
    proc = bench(cli_env, "--heads=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    assert re.fullmatch(r"CPU: .+; AMX: (yes|no); native bf16: .+", out[0])
    assert re.search(r"fold: 2 query block\(s\) of 200 rows \(the trainer; the trainer's choice here: 2\)", out[2])
    header = next(i for i, line in enumerate(out) if line.startswith("variant"))
    rows = [line.split() for line in out[header + 1 : header + 5]]
    assert [tuple(r[:2]) for r in rows] == [(v, p) for p in ("forward", "backward") for v in ("sdpa", "fold")]
    assert all(float(x) >= 0 for r in rows for x in r[2:]) and all(float(r[3]) > 0 for r in rows)
    ratios = {m[1]: float(m[2]) for line in out if (m := re.match(r"ratio (\w+) sdpa/fold: ([\d.]+) median", line))}
    assert set(ratios) == {"forward", "backward"} and all(r > 0 for r in ratios.values())
    assert [line for line in out if line.startswith("ratio backward")][0].endswith("the backward speed-up")
    assert "matmul peak probes before and after" in "\n".join(out[-2:])


def test_bench_attention_measures_a_given_fold_and_refuses_bad_sizes(cli_env):
    # 2 heads on 2 threads: the trainer folds nothing; --blocks 2 measures the fold anyway
    proc = bench(cli_env, "--heads=2", "--blocks=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fold: 2 query block(s) of 200 rows (--blocks; the trainer's choice here: 1)" in proc.stdout
    zero, many = bench(cli_env, "--heads=0"), bench(cli_env, "--heads=1", "--blocks=401")
    assert zero.returncode == many.returncode == 2
    assert "--heads, --tokens" in zero.stderr and "--blocks must be between 1 and --tokens (400)" in many.stderr
