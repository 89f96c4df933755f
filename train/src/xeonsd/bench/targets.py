"""The training step's targets, and whether a ``bench train`` run met them on the CPU it ran on.

- On AMX, the optimized step runs at least :data:`AMX_SHARE` of the bf16 matmul peak on counted FLOPs (textual
  inversion and LoRA at 512 px on SD 1.5, SDXL LoRA at 1024 px). A CPU without AMX cannot judge it: its bf16 is
  emulated or AVX512-BF16, another peak altogether.
- On every CPU, :data:`DIFFUSERS_SPEEDUP` times the speed of diffusers' example scripts at equal or lower peak
  RSS, for the jobs in :data:`SPEED_JOBS`. It is judged when the run had the variant "diffusers example"
  (``--diffusers-examples``, xeonsd.bench.diffusers_examples) beside the optimized one: the median of the
  rounds' ratios of its s/step to ours, and the peak RSS of both.
"""

from __future__ import annotations

AMX_SHARE = 0.45
DIFFUSERS_SPEEDUP = 2.0


# The families the targets were set for; the flow transformers have no target yet, their figures stand alone.
TARGET_FAMILIES = ("sd", "sdxl")
# The (method, family) jobs the speed target names: textual inversion and LoRA on SD 1.5, LoRA on SDXL.
SPEED_JOBS = (("textual_inversion", "sd"), ("lora", "sd"), ("lora", "sdxl"))


def speed_target(method: str, family: str, optimized: dict | None, reference: dict | None) -> tuple[bool | None, str]:
    """Whether ours ran at least :data:`DIFFUSERS_SPEEDUP` times diffusers' script's speed at no more peak RSS."""
    name = f"target: {DIFFUSERS_SPEEDUP:g}x the diffusers example scripts at equal or lower peak RSS"
    if (method, family) not in SPEED_JOBS:
        return (
            None,
            f"{name}: set for textual inversion and LoRA on SD 1.5 and LoRA on SDXL; this run is {method} on {family}",
        )
    if reference is None or optimized is None:
        return None, f"{name}: not judged: needs the optimized variant and --diffusers-examples (the script's variant)"
    speedup, ours, theirs = reference["x_optimized"], optimized["peak_rss_gb"], reference["peak_rss_gb"]
    met = speedup >= DIFFUSERS_SPEEDUP and ours <= theirs
    rounds = " ".join(f"{v:.2f}" for v in reference["x_optimized_rounds"])
    return met, (
        f"{name}: {'met' if met else 'not met'} ({speedup:.2f}x, rounds {rounds}; "
        f"peak RSS {ours:.2f} GB against {theirs:.2f})"
    )


def bench_targets(
    cpu,
    dtype: str,
    optimized: dict | None,
    family: str = "sd",
    method: str = "textual_inversion",
    reference: dict | None = None,
) -> list[dict]:
    """Each target, whether it was met (True/False, None: cannot be judged here) and the line that says it.
    ``cpu``: a ``xeonsd.cpu.CpuInfo``; ``optimized``: the optimized variant's result (None: not run); ``family``:
    the benchmarked model's family name (``xeonsd.families``); ``reference``: the result of the variant
    that ran diffusers' example script (None: not run)."""
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
    speed = speed_target(method, family, optimized, reference)
    return [
        {"target": "amx_share_of_bf16_peak", "value": AMX_SHARE, "met": amx[0], "line": amx[1]},
        {"target": "x_diffusers_examples", "value": DIFFUSERS_SPEEDUP, "met": speed[0], "line": speed[1]},
    ]
