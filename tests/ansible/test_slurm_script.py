"""The Slurm batch script (plugins/filter/xeonsd_slurm.py): its #SBATCH options from the inventory's values, a clear
refusal of each wrong value, and the script itself run by bash with a stand-in srun: the ranks' lines reach
train.log labelled as under mpirun -l (the poll reads them the same), srun's exit code is the job's, and a batch
script that Slurm started on another node than the primary refuses to run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from repo_code import ansible_code

from xeonsd.jobs.watch import rank_lines

xeonsd_slurm = ansible_code("xeonsd_slurm")

JOB = {
    "job_name": "xeonsd-20261201-101500",
    "nodes": ["node1", "node2", "node3", "node4"],
    "ranks_per_node": "4",
    "cpus_per_task": 14,
    "time_limit_s": "14400",
    "signal_s": 300,
    "partition": "cpu",
    "account": "",
    "command": ["xeonsd", "train", "--prompt=a <dicoo> toy", "--output_dir=/home/devcloud/runs/r1"],
}

# srun --label as Slurm prints it for a 16-task step (width 2), each rank on its own line, then its exit code.
FAKE_SRUN = """#!/bin/bash
printf ' 0: step 1 loss 0.1\\n12: Traceback (most recent call last)\\n12: ValueError: bad\\n'
echo "srun: error: node4: task 12: Exited with exit code 3" >&2
echo "$@" > srun.argv
exit 3
"""


def test_options_follow_the_inventory():
    assert xeonsd_slurm.sbatch_options(JOB) == [
        "--job-name=xeonsd-20261201-101500",
        "--nodes=4",
        "--nodelist=node1,node2,node3,node4",
        "--ntasks-per-node=4",
        "--cpus-per-task=14",
        "--time=4:00:00",
        "--signal=USR1@300",
        "--partition=cpu",
        "--output=slurm-%j.out",
        "--open-mode=append",
    ]
    assert xeonsd_slurm.hms(3725) == "1:02:05"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"nodes": []}, "nodes must be a non-empty list"),
        ({"nodes": ["node1", "node 2"]}, "node name 'node 2' is not a Slurm name"),
        ({"partition": "cpu;rm -rf"}, "partition 'cpu;rm -rf' is not a Slurm name"),
        ({"ranks_per_node": 0}, "ranks_per_node must be at least 1"),
        ({"cpus_per_task": "many"}, "cpus_per_task must be an integer"),
        ({"signal_s": 14400}, "Fix: make finetune_slurm_signal_s smaller than finetune_timeout_s"),
        ({"command": "xeonsd train"}, "command must be a non-empty argv list"),
    ],
)
def test_a_wrong_value_is_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        xeonsd_slurm.sbatch_script({**JOB, **change})
    with pytest.raises(ValueError, match="missing time_limit_s"):
        xeonsd_slurm.sbatch_script({k: v for k, v in JOB.items() if k != "time_limit_s"})


def _run(tmp_path: Path, node: str) -> subprocess.CompletedProcess:
    script = tmp_path / "job.sbatch"
    script.write_text(xeonsd_slurm.sbatch_script(JOB))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURMD_NODENAME": node}
    return subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, text=True, capture_output=True, timeout=30)


def test_the_script_labels_rank_lines_like_mpirun_and_passes_srun_exit_code(tmp_path):
    proc = _run(tmp_path, "node1")
    assert proc.returncode == 3
    lines = rank_lines((tmp_path / "train.log").read_text())
    assert lines == {0: ["step 1 loss 0.1"], 12: ["Traceback (most recent call last)", "ValueError: bad"]}
    assert "srun: error: node4: task 12" in (tmp_path / "train.log").read_text()
    argv = (tmp_path / "srun.argv").read_text().split()
    assert argv[:4] == ["--mpi=none", "--kill-on-bad-exit=1", "--label", "--chdir=/tmp"]
    assert "--prompt=a <dicoo> toy" in (tmp_path / "srun.argv").read_text()  # quoted through the shell intact


def test_a_batch_script_started_elsewhere_than_the_primary_refuses(tmp_path):
    proc = _run(tmp_path, "node3")
    assert proc.returncode == 2
    assert "runs on node3, not on the primary node1" in proc.stderr
    assert not (tmp_path / "train.log").exists()
