"""The playbooks' side of the tuned rank layout (plugins/filter/xeonsd_layout.py): the result doctor.yml keeps from
`xeonsd bench layout --json`, its lines, and ranks_per_node / mpi_ranks auto as the finetune role resolves them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from repo_code import ansible_code

from xeonsd.contracts import layout_result

xeonsd_layout = ansible_code("xeonsd_layout")
NODES = ["node1", "node2", "node3", "node4"]
RESULT = {
    "schema": layout_result.SCHEMA,
    "node": "node1",
    "cores": 2,
    "rounds": 2,
    "steps": 2,
    "layouts": [
        {
            "ranks_per_node": 1,
            "threads_per_rank": 2,
            "status": "measured",
            "images_per_s": [0.2, 0.1],
            "median_images_per_s": 0.15,
            "ratio_to_first": 1.0,
            "detail": "",
        },
        {
            "ranks_per_node": 2,
            "threads_per_rank": 1,
            "status": "measured",
            "images_per_s": [0.22, 0.11],
            "median_images_per_s": 0.165,
            "ratio_to_first": 1.1,
            "detail": "",
        },
    ],
    "best": {"ranks_per_node": 2, "threads_per_rank": 1, "images_per_s": 0.165},
}


def test_the_play_keeps_the_last_json_line_and_prints_a_line_per_layout() -> None:
    kept = xeonsd_layout.layout_result(["round 1/2: …", json.dumps({"schema": "old"}), json.dumps(RESULT)])
    assert kept == RESULT
    lines = xeonsd_layout.layout_lines(kept)
    assert lines[0] == "node1: 2 physical cores, 2 round(s) of 2 step(s)"
    assert "0.165 images/s per node (rounds 0.220 0.110; 1.10x the first layout)" in lines[2]
    assert lines[-1] == "best: 2 ranks per node x 1 threads (0.165 images/s)"
    with pytest.raises(ValueError, match="printed no result"):
        xeonsd_layout.layout_result(["xeonsd bench layout: error: mpirun is not on the PATH"])


def test_auto_is_the_best_layout_for_the_finetune_role_and_a_missing_result_says_what_to_run(tmp_path: Path) -> None:
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(RESULT))
    per_node = xeonsd_layout.ranks_per_node("auto", str(path))
    assert (per_node, xeonsd_layout.mpi_ranks("auto", NODES, per_node)) == (2, 8)
    assert xeonsd_layout.mpi_ranks(16, NODES, 4) == 16
    with pytest.raises(ValueError, match=r"Fix: run ansible-playbook doctor.yml -e tune_layout=true"):
        xeonsd_layout.ranks_per_node("auto", str(tmp_path / "none.json"))
    assert xeonsd_layout.ranks_per_node("auto", str(tmp_path / "none.json"), 1) == 1  # doctor's checks until tuned
    with pytest.raises(TypeError, match="list of hosts"):
        xeonsd_layout.mpi_ranks("auto", "node1", 2)


def test_the_finetune_role_warns_when_the_result_was_tuned_for_another_method(tmp_path: Path) -> None:
    path = tmp_path / "layout.json"
    path.write_text(json.dumps({**RESULT, "train_args": ["--method=textual_inversion", "--resolution=512"]}))
    assert xeonsd_layout.layout_stale(str(path), ["--method=textual_inversion", "--resolution=512"]) == ""
    warning = xeonsd_layout.layout_stale(str(path), ["--method=lora", "--resolution=512"])
    assert "measured with --method=textual_inversion, the job now has --method=lora" in warning
    with pytest.raises(TypeError, match="list of arguments"):
        xeonsd_layout.layout_stale(str(path), "--method=lora")
