"""The run_report role hands `xeonsd runjson` the play's facts: that task's vars, rendered by Ansible as the play
would (with and without an export in the play), are what xeonsd.contracts.run_files reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from repo_code import REPO, VENV_BIN

from xeonsd.contracts import run_files
from xeonsd.jobs import attempts

TASKS = REPO / "roles" / "run_report" / "tasks" / "main.yml"


def _runjson_task() -> dict:
    (task,) = [t for t in yaml.safe_load(TASKS.read_text()) if "runjson" in str(t.get("ansible.builtin.command"))]
    return task


def _render_facts(tmp_path: Path, play_vars: dict) -> dict:
    """The task's stdin as Ansible renders it on the primary of the repository's inventory."""
    task = _runjson_task()
    play = [
        {
            "hosts": "node1",
            "gather_facts": False,
            "connection": "local",
            "vars": {
                "ansible_python_interpreter": sys.executable,
                "run_report_name": "r1",
                "run_report_node_hour_price": "",
                "run_report_currency": "EUR",
                "run_report_gpu_hour_price": "",
                "run_report_gpu_s_per_step": "",
                # Outside a role, paths.yml's default (under role_path) has nothing to derive from.
                "layout_result_file": str(tmp_path / "layout.json"),
                **play_vars,
            },
            "tasks": [
                {
                    "ansible.builtin.copy": {
                        "content": task["ansible.builtin.command"]["stdin"],
                        "dest": str(tmp_path / "facts.json"),
                        "mode": "0644",
                    },
                    "vars": task["vars"],
                }
            ],
        }
    ]
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play))
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    proc = subprocess.run(
        [str(VENV_BIN / "ansible-playbook"), "-i", "inventory", str(tmp_path / "play.yml")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / "facts.json").read_text())


@pytest.mark.parametrize("exported", [False, True, "skipped"])
def test_the_role_s_facts_are_what_runjson_reads(tmp_path: Path, exported: bool | str) -> None:
    """Without export.yml, with an export, and with the export skipped (a family without one: the images are the
    torch engine's), which records no export and no export phase."""
    play_vars = {}
    if exported == "skipped":
        play_vars = {
            "openvino_export_ov_dir": "/b/x",
            "openvino_export_export": {
                "changed": False,
                "skipped": True,
                "skip_reason": "Conditional result was False",
            },
            "openvino_export_generate": {"changed": True, "delta": "0:00:30.5", "rc": 0},
        }
    elif exported:
        play_vars = {
            "openvino_export_ov_dir": "/b/x",
            "openvino_export_export": {"changed": True, "delta": "0:01:00.04", "rc": 0},
            "openvino_export_generate": {"changed": True, "delta": "0:00:30.5", "rc": 0},
        }
    facts = _render_facts(tmp_path, play_vars)
    assert facts["nodes"] == ["node1", "node2", "node3", "node4"] and facts["primary"] == "node1"
    run = tmp_path / "run"
    run.mkdir()
    attempts.begin_attempt(run, now=100)
    attempts.write_exit(run, 0, now=190)
    (run / "train_summary.json").write_text(json.dumps({"method": "lora"}))
    info = run_files.run_json(run, facts)  # an input it does not know would be refused
    assert info["cluster"] == {
        "nodes": "node1, node2, node3, node4",
        "MPI ranks": 16,
        "ranks per node": 4,
        "primary": "node1",
    }
    assert "cost" not in info
    if exported == "skipped":
        assert facts["export"] is None and "export" not in info
        assert info["phases"] == {"training job, wall (s)": 90, "generate, whole command (s)": 30.5}
    elif exported:
        assert info["phases"] == {
            "training job, wall (s)": 90,
            "OpenVINO export (s)": 60.0,
            "generate, whole command (s)": 30.5,
        }
        assert info["export"] == {"dir": "/b/x", "of": "the base model (shared by its runs)", "reused": False}
    else:
        assert info["phases"] == {"training job, wall (s)": 90} and "export" not in info


def test_a_tuned_layout_is_what_the_report_records_for_ranks_per_node_auto(tmp_path: Path) -> None:
    from xeonsd.contracts import layout_result

    best = {"ranks_per_node": 2, "threads_per_rank": 28, "images_per_s": 0.5}
    (tmp_path / "layout.json").write_text(json.dumps({"schema": layout_result.SCHEMA, "best": best}))
    facts = _render_facts(tmp_path, {"ranks_per_node": "auto", "mpi_ranks": "auto"})
    assert (int(facts["ranks_per_node"]), int(facts["mpi_ranks"])) == (2, 8)
