"""The training step's targets (issue 36), and whether a ``bench train`` run met them on the CPU it ran on.

- On AMX, the optimized step runs at least :data:`AMX_SHARE` of the bf16 matmul peak on counted FLOPs (textual
  inversion and LoRA at 512 px on SD 1.5, SDXL LoRA at 1024 px). A CPU without AMX cannot judge it: its bf16 is
  emulated or AVX512-BF16, another peak altogether.
- On every CPU, :data:`DIFFUSERS_SPEEDUP` times the speed of diffusers' example scripts at equal or lower peak
  RSS. ``bench train`` does not run those scripts, so it says so instead of guessing; the interleaved
  comparisons are in docs/benchmarks.md.
"""

from __future__ import annotations

AMX_SHARE = 0.45
DIFFUSERS_SPEEDUP = 2.0


# The families the targets were set for (issue 36); the flow transformers have no target yet, their figures stand alone.
TARGET_FAMILIES = ("sd", "sdxl")


def bench_targets(cpu, dtype: str, optimized: dict | None, family: str = "sd") -> list[dict]:
    """Each target, whether it was met (True/False, None: cannot be judged here) and the line that says it.
    ``cpu``: a ``xeonsd.cpu.CpuInfo``; ``optimized``: the optimized variant's result (None: not run); ``family``:
    the benchmarked model's family name (``xeonsd.modelfiles.families``)."""
    name = f"target: at least {AMX_SHARE:.0%} of the bf16 matmul peak on AMX"
    if family not in TARGET_FAMILIES:
        amx = (None, f"{name}: set for SD 1.x/2.x and SDXL; this run is {family} (its share is in the table)")
    elif not cpu.amx_bf16:
        amx = (None, f"{name}: cannot be judged on this CPU ({cpu.model}: no AMX)")
    elif optimized is None or dtype != "bf16":
        amx = (None, f"{name}: not judged: needs the optimized variant in bf16 (this run: {dtype})")
    else:
        share = optimized["of_peak"]
        amx = (share >= AMX_SHARE, f"{name}: {'met' if share >= AMX_SHARE else 'not met'} ({share:.1%})")
    speed = (
        None,
        f"target: {DIFFUSERS_SPEEDUP:g}x the diffusers example scripts at equal or lower peak RSS: not judged by "
        "this run (it does not run diffusers' scripts; see docs/benchmarks.md for the interleaved comparison)",
    )
    return [
        {"target": "amx_share_of_bf16_peak", "value": AMX_SHARE, "met": amx[0], "line": amx[1]},
        {"target": "x_diffusers_examples", "value": DIFFUSERS_SPEEDUP, "met": speed[0], "line": speed[1]},
    ]
