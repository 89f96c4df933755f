"""The rank layouts of a node and the tuning result that ``ranks_per_node: auto`` reads (xeonsd.contracts.layout_result),
and how ``xeonsd bench layout`` turns its trials into that result."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from xeonsd.bench import layout as bench_layout
from xeonsd.contracts import layout_result as lr


def test_layouts_split_the_physical_cores_every_way() -> None:
    assert lr.layouts(2) == [(1, 2), (2, 1)]
    assert lr.layouts(56) == [(1, 56), (2, 28), (4, 14), (7, 8), (8, 7), (14, 4), (28, 2), (56, 1)]
    assert lr.layouts(56, [4, 56]) == [(4, 14), (56, 1)]
    assert lr.layouts(1) == [(1, 1)]


def test_layouts_refuse_ranks_that_do_not_divide_the_cores() -> None:
    with pytest.raises(lr.LayoutError, match=r"\[3\] do not split this node's 56 physical cores.*1, 2, 4, 7"):
        lr.layouts(56, [4, 3])
    with pytest.raises(lr.LayoutError, match="at least 1 physical core"):
        lr.layouts(0)


def _result(tmp_path: Path, figures: dict[str, list[float]], skipped=None) -> dict:
    by_name = {n: tuple(int(x) for x in n.split("x")) for n in figures}
    args = argparse.Namespace(rounds=len(next(iter(figures.values()))), steps=2)
    return bench_layout.build_result(2, figures, by_name, skipped or {}, ["--resolution=64"], args)


def test_the_best_layout_is_the_highest_median_and_ratios_are_per_round(tmp_path: Path) -> None:
    # The machine slows down in round 2; 2x1 stays 1.1x ahead of 1x2 within each round.
    res = _result(tmp_path, {"1x2": [0.20, 0.10], "2x1": [0.22, 0.11]}, {(4, 1): "does not fit"})
    assert res["best"] == {"ranks_per_node": 2, "threads_per_rank": 1, "images_per_s": pytest.approx(0.165)}
    two = next(m for m in res["layouts"] if m["ranks_per_node"] == 2)
    assert two["ratio_to_first"] == pytest.approx(1.1)
    assert [m["status"] for m in res["layouts"]] == ["measured", "measured", "skipped"]
    lines = lr.result_lines(res)
    assert lines[-1] == "best: 2 ranks per node x 1 threads (0.165 images/s)"
    assert "skipped (does not fit)" in lines[-2]
    path = tmp_path / lr.FILE_NAME
    path.write_text(json.dumps(res))
    assert lr.resolve_ranks_per_node("auto", path) == 2
    assert lr.resolve_mpi_ranks("auto", 4, lr.resolve_ranks_per_node("auto", path)) == 8


def test_no_measured_layout_is_an_error_that_says_why() -> None:
    with pytest.raises(lr.LayoutError, match="no layout could be measured: does not fit"):
        lr.best_layout([{"ranks_per_node": 2, "status": "skipped", "detail": "does not fit"}])


def test_numbers_pass_through_and_auto_needs_a_result(tmp_path: Path) -> None:
    assert lr.resolve_ranks_per_node(4, tmp_path / "none.json") == 4
    assert lr.resolve_ranks_per_node("4", tmp_path / "none.json") == 4
    assert lr.resolve_mpi_ranks(16, 4, 4) == 16
    with pytest.raises(lr.LayoutError, match=r"no tuning result at .*none.json\. Fix: run ansible-playbook doctor"):
        lr.resolve_ranks_per_node("auto", tmp_path / "none.json")
    with pytest.raises(lr.LayoutError, match="ranks_per_node must be a number or auto, not 'four'"):
        lr.resolve_ranks_per_node("four", tmp_path / "none.json")
    with pytest.raises(lr.LayoutError, match="mpi_ranks must be a number or auto"):
        lr.resolve_mpi_ranks("many", 4, 4)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "is not JSON"),
        ('{"schema": "other/1"}', "schema 'other/1', expected 'xeonsd-layout/1'"),
        ('{"schema": "xeonsd-layout/1", "best": {"ranks_per_node": 0}}', "has no best layout"),
        ('{"schema": "xeonsd-layout/1"}', "has no best layout"),
    ],
)
def test_a_broken_result_is_refused_with_the_fix(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / lr.FILE_NAME
    path.write_text(text)
    with pytest.raises(lr.LayoutError, match=message) as err:
        lr.resolve_ranks_per_node("auto", path)
    assert lr.FIX in str(err.value)


def test_a_trial_takes_the_steps_after_the_warmup_and_leaves_the_jobs_flags_out(tmp_path: Path) -> None:
    rows = [{"step": 1, "images_per_s": 9.0}, {"step": 2, "images_per_s": 1.0}, {"step": 3, "images_per_s": 3.0}]
    assert bench_layout.images_per_s(rows, warmup=1) == 2.0
    cmd = bench_layout.trial_command(
        "mpirun",
        2,
        ["--resolution=64", "--output_dir=/job", "--validation_prompt=x", "--max_train_steps=500"],
        3,
        tmp_path,
    )
    assert cmd[:5] == ["mpirun", "-n", "2", "-ppn", "2"]
    assert "--resolution=64" in cmd and "--max_train_steps=3" in cmd and f"--output_dir={tmp_path}" in cmd
    assert not [c for c in cmd if c in ("--output_dir=/job", "--validation_prompt=x", "--max_train_steps=500")]
    # MASTER_ADDR of another node (192.0.2.1: TEST-NET, on no interface here): a rendezvous on this node instead.
    env = bench_layout.trial_env({"PMI_RANK": "1", "OMP_NUM_THREADS": "8", "MASTER_ADDR": "192.0.2.1", "PATH": "/x"})
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["PATH"] == "/x" and int(env["MASTER_PORT"]) > 0
    assert "PMI_RANK" not in env and "OMP_NUM_THREADS" not in env


def _tuned(tmp_path: Path, train_args: list[str]) -> Path:
    path = tmp_path / "layout.json"
    result = bench_layout.build_result(
        2,
        {"1x2": [0.2], "2x1": [0.3]},
        {"1x2": (1, 2), "2x1": (2, 1)},
        {},
        train_args,
        argparse.Namespace(rounds=1, steps=2),
    )
    path.write_text(json.dumps(result))
    return path


def test_a_result_tuned_for_other_training_arguments_is_named_stale_with_what_changed(tmp_path: Path) -> None:
    path = _tuned(tmp_path, ["--method=lora", "--resolution=512", "--output_dir=/runs/a", "--max_train_steps=200"])
    # The run's own flags (output dir, steps) and the order do not make it stale.
    same = ["--max_train_steps=30", "--resolution=512", "--method=lora", "--output_dir=/runs/b"]
    assert lr.stale_reasons(lr.read(path), same) == []
    assert lr.stale_warning(path, same) == ""
    other = ["--method=lora", "--resolution=1024", "--train_batch_size=2"]
    assert lr.stale_reasons(lr.read(path), other) == [
        "it was measured with --resolution=512, the job now has --resolution=1024 --train_batch_size=2"
    ]
    warning = lr.stale_warning(path, other)
    assert warning.startswith(f"WARNING: ranks_per_node is auto and uses the tuning result {path}")
    assert "its best layout (2 ranks per node)" in warning and "doctor.yml -e tune_layout=true" in warning
    # No result: nothing to warn about here (ranks_per_node auto itself fails, saying to tune).
    assert lr.stale_warning(tmp_path / "none.json", other) == ""
