"""``xeonsd doctor -- TRAIN_ARGS``: the recipe's troubleshooting advice as one command, run on one node.

"Run the training locally on every node for one step before launching the distributed job": it checks the
packages, the preloaded tcmalloc, AMX, the images and the model named in the training arguments, then trains one
step as a single process with exactly those arguments. Every check reports PASS, WARN or FAIL with its cause;
the exit code is 1 when any check fails, 2 when the model cannot be found (after the table, one line says what to
do, as ``xeonsd train`` would). ``--json`` prints the same as one JSON object (doctor.yml reads it).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from xeonsd.contracts.method_names import METHOD_FILES
from xeonsd.cpu import cpu_info
from xeonsd.modelfiles.modelsource import ModelSourceError, check_model_source

PACKAGES = ("torch", "diffusers", "transformers", "safetensors", "xeonsd")
# Variables of a launcher: the one-step trial must run as a single process, not join a job.
_LAUNCHER_VARS = ("PMI_", "MPI_LOCAL", "OMPI_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "HYDRA_")


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # PASS, WARN, FAIL
    detail: str
    seconds: float | None = None  # the one-step trial's time (doctor.yml compares the nodes')


def _import_all(names) -> tuple[list[str], list[str]]:
    """(["name version", ...] of the packages that import, ["name (error)", ...] of those that do not)."""
    found, missing = [], []
    for name in names:
        try:
            mod = importlib.import_module(name)
        except ImportError as exc:
            missing.append(f"{name} ({exc})")
            continue
        found.append(f"{name} {getattr(mod, '__version__', '?')}")
    return found, missing


def check_packages() -> Check:
    versions, missing = _import_all(PACKAGES)
    if missing:
        return Check("packages", "FAIL", "missing package: " + "; ".join(missing))
    return Check("packages", "PASS", ", ".join(versions))


def check_tcmalloc(env: dict[str, str]) -> Check:
    preload = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p]
    tcmalloc = [p for p in preload if "tcmalloc" in Path(p).name]
    if not tcmalloc:
        return Check("tcmalloc", "WARN", "not preloaded (LD_PRELOAD has no libtcmalloc; source the cluster's env.sh)")
    for lib in tcmalloc:
        try:
            ctypes.CDLL(lib)
        except OSError as exc:
            return Check("tcmalloc", "FAIL", f"LD_PRELOAD names {lib}, which does not load: {exc}")
    return Check("tcmalloc", "PASS", ", ".join(tcmalloc))


def check_cpu() -> Check:
    info = cpu_info()
    native = info.native_bf16
    if native == "AMX":
        return Check("amx", "PASS", f"{info.model}: amx_bf16 + amx_tile")
    what = f"only {native}" if native else "no native bf16 (emulated, slow)"
    return Check("amx", "WARN", f"{info.model}: no AMX; {what}; use --mixed_precision no or auto here")


def check_method(method: str) -> Check:
    """The packages the chosen method needs on this node (LoRA: peft)."""
    found, missing = _import_all(METHOD_FILES[method]["needs"])
    if missing:
        fix = "install requirements.txt into the env (provision.yml)"
        return Check("method", "FAIL", f"--method {method} needs {'; '.join(missing)}: {fix}")
    return Check("method", "PASS", method + (": " + ", ".join(found) if found else ""))


def check_inputs(train_args: list[str], ranks_per_node: int = 1) -> list[Check]:
    from xeonsd.trainer.argv import parse_config
    from xeonsd.trainer.captions import read_captions
    from xeonsd.trainer.config import ConfigError
    from xeonsd.trainer.data import DataError, find_images
    from xeonsd.trainer.methods import for_config
    from xeonsd.trainer.models import model_family
    from xeonsd.trainer.resolution import with_resolution

    try:
        cfg = parse_config(train_args)
    except ConfigError as exc:
        return [Check("arguments", "FAIL", str(exc))]
    checks = [check_method(cfg.method)]
    images, captions = [], None
    try:
        images = find_images(Path(cfg.train_data_dir))
        checks.append(Check("images", "PASS", f"{len(images)} readable images in {cfg.train_data_dir}"))
        captions = read_captions(Path(cfg.train_data_dir), images, cfg.caption_column)
        for_config(cfg).check(cfg, captions)
        instead = "templates" if cfg.method == "textual_inversion" else "--instance_prompt"
        found = f"{len(captions.texts)} from {captions.source}" if captions else f"none ({instead})"
        checks.append(Check("captions", "PASS", found))
    except (DataError, ConfigError) as exc:
        checks.append(Check("images" if not images else "captions", "FAIL", str(exc)))
    try:
        source = check_model_source(cfg.pretrained_model_name_or_path, revision=cfg.revision)
        # a family we do not serve (SD3, Flux, an SDXL refiner, …) fails here, before the trial step loads it
        family = model_family(cfg)
    except (ModelSourceError, ConfigError) as exc:
        checks.append(Check("model", "FAIL", str(exc)))
        return checks
    # A download on every node at the job's start is what the base_model role exists to avoid.
    checks.append(Check("model", "WARN" if source.kind == "hub" else "PASS", f"{source.detail}; {family.label}"))
    cfg = with_resolution(cfg, family)  # the memory row at the resolution the job trains at
    if images:
        checks.append(check_memory(cfg, len(images), len(captions.texts) if captions else 1, ranks_per_node))
    return checks


def check_memory(cfg, num_images: int, num_prompts: int, ranks_per_node: int) -> Check:
    """The trainer's own estimate of a rank's peak memory, for this node's ranks, against its free memory."""
    import dataclasses

    from xeonsd.trainer import memory
    from xeonsd.trainer.shared_weights import shares_weights

    if cfg.mixed_precision == "auto":
        cfg = dataclasses.replace(cfg, mixed_precision="bf16" if cpu_info().native_bf16 else "no")
    try:
        est = memory.estimate(cfg, cfg.method, num_images, num_prompts, cfg.world_size or ranks_per_node)
    except Exception as exc:  # noqa: BLE001 - reported as a row, not a crash
        return Check("memory", "WARN", f"no estimate: {exc}")
    free = memory.available_memory()
    shared = shares_weights(cfg.share_weights, ranks_per_node)
    problem = memory.check_fits(est, ranks_per_node, free, shared)
    if problem:
        return Check("memory", "FAIL", problem)
    room = f", {free / memory.GB:.1f} GB free" if free is not None else ""
    at = f" at {cfg.resolution} px" if cfg.resolution else ""
    node = est.per_node(ranks_per_node, shared)
    how = " (frozen weights shared)" if shared else ""
    return Check(
        "memory",
        "PASS",
        f"node {node / memory.GB:.2f} GB for {ranks_per_node} rank(s){how}{at}{room}; per rank {est.describe()}",
    )


def trial_step(train_args: list[str], env: dict[str, str], timeout: float) -> Check:
    """One training step as a single process, with the job's own arguments (output to a scratch dir)."""
    clean = {k: v for k, v in env.items() if not k.startswith(_LAUNCHER_VARS)}
    with tempfile.TemporaryDirectory(prefix="xeonsd-doctor-") as out:
        cmd = [
            sys.executable,
            "-m",
            "xeonsd.cli",
            "train",
            *train_args,
            "--max_train_steps=1",
            "--checkpointing_steps=0",
            f"--output_dir={out}",
            "--overwrite_output_dir",
            "--log_every=1",
        ]
        cmd = [c for c in cmd if not c.startswith(("--validation_prompt", "--resume_from_checkpoint", "--world_size"))]
        try:
            proc = subprocess.run(cmd, env=clean, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return Check("train 1 step", "FAIL", f"did not finish within {timeout:.0f} s")
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            cause = next((ln for ln in reversed(lines) if "error" in ln.lower()), lines[-1] if lines else "no output")
            return Check("train 1 step", "FAIL", cause.strip()[-400:])
        metrics = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return Check(
        "train 1 step",
        "PASS",
        f"loss {metrics[-1]['loss']:.4f} in {metrics[-1]['s_per_step']:.1f} s",
        round(metrics[-1]["s_per_step"], 3),
    )


def node_facts() -> dict:
    """What doctor.yml puts side by side for every node: the CPU model, its physical cores, AMX."""
    from xeonsd.cluster.placement import physical_cores

    info = cpu_info()
    return {
        "cpu_model": info.model,
        "cores": len(physical_cores(set(os.sched_getaffinity(0)))),
        "logical_cpus": os.cpu_count(),
        "amx": info.amx_bf16,
    }


def run_checks(
    train_args: list[str], env: dict[str, str], timeout: float, skip_train: bool, ranks_per_node: int = 1
) -> list[Check]:
    checks = [check_packages(), check_tcmalloc(env), check_cpu(), *check_inputs(train_args, ranks_per_node)]
    if skip_train:
        return checks
    if all(c.status != "FAIL" for c in checks):
        return [*checks, trial_step(train_args, env, timeout)]
    return [*checks, Check("train 1 step", "FAIL", "skipped: fix the failures above first")]


def format_table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    return "\n".join(f"{c.name:<{width}}  {c.status:<4}  {c.detail}" for c in checks)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="xeonsd doctor",
        description=__doc__.splitlines()[0],
        usage="xeonsd doctor [--json] [--skip-train] [--timeout S] [--ranks-per-node N] -- TRAIN_ARGS…",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--skip-train", action="store_true", help="check only, do not train a step")
    parser.add_argument("--timeout", type=float, default=900, help="seconds the one-step trial may take")
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=1,
        help="ranks the job runs on this node (the memory check counts them all)",
    )
    if "--" not in argv:
        parser.error("give the training arguments after --, e.g. xeonsd doctor -- --pretrained_model_name_or_path …")
    split = argv.index("--")
    args = parser.parse_args(argv[:split])
    train_args = argv[split + 1 :]
    checks = run_checks(train_args, dict(os.environ), args.timeout, args.skip_train, args.ranks_per_node)
    ok = all(c.status != "FAIL" for c in checks)
    if args.json:
        host = os.uname().nodename
        print(json.dumps({"host": host, "ok": ok, "checks": [asdict(c) for c in checks], "node": node_facts()}))
    else:
        print(format_table(checks))
    model_error = next((c.detail for c in checks if c.name == "model" and c.status == "FAIL"), None)
    if model_error:
        print(f"xeonsd doctor: error: {model_error}", file=sys.stderr, flush=True)
        return 2
    return 0 if ok else 1
