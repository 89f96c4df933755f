"""xeonsd doctor: a node's PASS/FAIL table with the cause, and the one-step trial with the job's arguments."""

from __future__ import annotations

import json
from pathlib import Path

from cli_runs import run_cli


def _job_args(model: Path, data: Path) -> list[str]:
    return [
        f"--pretrained_model_name_or_path={model}",
        f"--train_data_dir={data}",
        "--placeholder_token=<dicoo>",
        "--initializer_token=toy",
        "--resolution=64",
        "--train_batch_size=1",
        "--max_train_steps=200",
        "--mixed_precision=no",
        "--output_dir=/nonexistent/run",
        "--resume_from_checkpoint=latest",
    ]


def _doctor(args: list[str], env: dict[str, str]) -> tuple[int, dict]:
    proc = run_cli(["doctor", "--json", "--", *args], env, timeout=600)
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


def test_doctor_passes_a_healthy_node_and_trains_one_step(tiny_model, dataset, cli_env):
    env = {k: v for k, v in cli_env.items() if k != "LD_PRELOAD"}
    rc, report = _doctor(_job_args(tiny_model, dataset), env)
    checks = {c["name"]: c for c in report["checks"]}
    assert rc == 0 and report["ok"], report
    assert checks["images"]["status"] == "PASS" and "5 readable images" in checks["images"]["detail"]
    assert checks["train 1 step"]["status"] == "PASS" and "loss" in checks["train 1 step"]["detail"]
    assert checks["tcmalloc"]["status"] == "WARN"  # not preloaded in the test environment
    # What doctor.yml compares between the nodes: the trial step's time, the CPU model, cores and AMX.
    assert checks["train 1 step"]["seconds"] > 0
    assert report["node"]["cores"] >= 1 and report["node"]["cpu_model"] and isinstance(report["node"]["amx"], bool)


def test_doctor_flags_missing_images_and_skips_the_trial(tiny_model, tmp_path, cli_env):
    rc, report = _doctor(_job_args(tiny_model, tmp_path / "dicoo"), cli_env)
    checks = {c["name"]: c for c in report["checks"]}
    assert rc == 1 and not report["ok"]
    assert checks["images"]["status"] == "FAIL" and "dicoo does not exist" in checks["images"]["detail"]
    assert checks["train 1 step"]["status"] == "FAIL" and "skipped" in checks["train 1 step"]["detail"]


def test_doctor_flags_a_tcmalloc_that_does_not_load(tiny_model, dataset, tmp_path, cli_env):
    bogus = tmp_path / "libtcmalloc.so.4"
    bogus.write_text("not a library")
    env = dict(cli_env, LD_PRELOAD=str(bogus))
    rc, report = _doctor([*_job_args(tiny_model, dataset)], env)
    checks = {c["name"]: c for c in report["checks"]}
    assert rc == 1 and checks["tcmalloc"]["status"] == "FAIL" and str(bogus) in checks["tcmalloc"]["detail"]


def test_doctor_names_a_model_it_cannot_find_and_exits_2(dataset, cli_env):
    proc = run_cli(["doctor", "--json", "--", *_job_args(Path("nope/dir"), dataset)], cli_env, timeout=600)
    checks = {c["name"]: c for c in json.loads(proc.stdout.strip().splitlines()[-1])["checks"]}
    assert proc.returncode == 2
    model = checks["model"]
    assert model["status"] == "FAIL" and model["detail"].startswith("--pretrained_model_name_or_path nope/dir: ")
    assert "offline: HF_HUB_OFFLINE=1" in model["detail"] and "base_model role" in model["detail"]
    assert checks["images"]["status"] == "PASS" and checks["train 1 step"]["detail"].startswith("skipped")
    assert proc.stderr.strip().splitlines()[-1] == f"xeonsd doctor: error: {model['detail']}"


def test_doctor_checks_what_the_chosen_method_imports(tiny_model, dataset, tmp_path, cli_env):
    """--method lora needs peft: PASS with its version on a healthy node; FAIL naming it where it does not import
    (a peft package that raises on import, first on PYTHONPATH)."""
    lora = [a for a in _job_args(tiny_model, dataset) if not a.startswith(("--placeholder", "--initializer"))]
    lora += ["--method=lora", "--instance_prompt=a photo of a toy"]
    proc = run_cli(["doctor", "--json", "--skip-train", "--", *lora], cli_env, timeout=600)
    checks = {c["name"]: c for c in json.loads(proc.stdout.strip().splitlines()[-1])["checks"]}
    assert checks["method"]["status"] == "PASS" and checks["method"]["detail"].startswith("lora: peft "), checks
    broken = tmp_path / "broken"
    (broken / "peft").mkdir(parents=True)
    (broken / "peft" / "__init__.py").write_text("raise ImportError('peft is broken on this node')\n")
    env = dict(cli_env, PYTHONPATH=f"{broken}:{cli_env.get('PYTHONPATH', '')}")
    proc = run_cli(["doctor", "--json", "--skip-train", "--", *lora], env, timeout=600)
    checks = {c["name"]: c for c in json.loads(proc.stdout.strip().splitlines()[-1])["checks"]}
    assert proc.returncode == 1
    assert checks["method"]["status"] == "FAIL" and "peft is broken on this node" in checks["method"]["detail"]
