"""train_summary.json and run.json (xeonsd.contracts.run_files): their schemas, the phase times from the play's
H:M:S deltas and exit.json, and `xeonsd runjson` as the run_report role runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from xeonsd.contracts import run_files
from xeonsd.jobs import attempts

FACTS = {
    "run": "r1",
    "nodes": ["node1", "node2"],
    "mpi_ranks": 8,
    "ranks_per_node": 4,
    "primary": "node1",
    "export": None,
    "generate": None,
    "cost": {"node_hour_price": "", "currency": "USD", "gpu_hour_price": "", "gpu_s_per_step": ""},
}


def test_train_summary_has_the_fields_its_readers_use() -> None:
    summary = run_files.train_summary(
        {"method": "lora", "trainable_params": 10, "lora_rank": 4},
        base_model="m",
        base_model_fingerprint="f",
        steps=3,
        ranks=2,
        allreduce_bytes_per_step=44,
        prompts={"source": "captions", "count": 5, "per_image": True},
        result_path="pytorch_lora_weights.safetensors",
        result_bytes=100,
    )
    assert summary == {
        "method": "lora",
        "trainable_params": 10,
        "lora_rank": 4,
        "base_model": "m",
        "base_model_fingerprint": "f",
        "steps": 3,
        "ranks": 2,
        "allreduce_bytes_per_step": 44,
        "prompts": {"source": "captions", "count": 5, "per_image": True},
        "result": {"path": "pytorch_lora_weights.safetensors", "bytes": 100},
    }


def test_hms_deltas() -> None:
    assert run_files.hms_seconds("1:02:03.250000") == 3723.2
    assert run_files.hms_seconds("0:00:07.04") == 7.0
    assert run_files.hms_seconds(None) is None and run_files.hms_seconds("") is None
    assert run_files.hms_seconds("skipped") is None


def test_run_json_phases_export_and_cost(tmp_path: Path) -> None:
    run = tmp_path
    assert run_files.run_json(run, FACTS) == {
        "title": "xeonsd run r1",
        "phases": {},
        "cluster": {"nodes": "node1, node2", "MPI ranks": 8, "ranks per node": 4, "primary": "node1"},
    }
    attempts.begin_attempt(run, now=100)
    attempts.write_exit(run, 0, now=190)
    (run / "train_summary.json").write_text(json.dumps({"method": "textual_inversion"}))
    facts = {
        **FACTS,
        "export": {"dir": "/b/x", "changed": True, "delta": "0:01:00.04"},
        "generate": {"delta": "0:00:30.5"},
        "cost": {**FACTS["cost"], "node_hour_price": 1.5},
    }
    info = run_files.run_json(run, facts)
    assert info["phases"] == {
        "training job, wall (s)": 90,
        "OpenVINO export (s)": 60.0,
        "generate, whole command (s)": 30.5,
    }
    assert info["export"] == {"dir": "/b/x", "of": "the base model (shared by its runs)", "reused": False}
    assert info["cost"] == {"node_hour_price": 1.5, "currency": "USD", "gpu_hour_price": "", "gpu_s_per_step": ""}
    # Reused (the export command did nothing): 0 s; a full fine-tune's export is of its own pipeline.
    (run / "train_summary.json").write_text(json.dumps({"method": "full"}))
    info = run_files.run_json(run, {**facts, "export": {"dir": "/r/openvino", "changed": False, "delta": None}})
    assert info["phases"]["OpenVINO export (s)"] == 0.0
    assert info["export"] == {"dir": "/r/openvino", "of": "its own pipeline", "reused": True}


def test_xeonsd_runjson_writes_run_json_once(tmp_path: Path, cli_env: dict) -> None:
    def runjson(facts: dict) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "xeonsd.cli", "runjson", str(tmp_path)],
            input=json.dumps(facts),
            env=cli_env,
            capture_output=True,
            text=True,
        )

    first = runjson(FACTS)
    assert first.returncode == 0 and json.loads(first.stdout) == {"changed": True}, first.stderr
    assert json.loads((tmp_path / "run.json").read_text())["title"] == "xeonsd run r1"
    assert json.loads(runjson(FACTS).stdout) == {"changed": False}
    wrong = runjson({**FACTS, "exports": {}})
    assert wrong.returncode == 2 and "unknown run.json input(s) exports" in wrong.stderr
