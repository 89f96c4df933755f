"""finetune.yml with finetune_launcher=slurm on the test cluster made a Slurm cluster (tests/cluster/slurm.py): the
16-rank job as one batch job (sbatch from the primary, the ranks srun's tasks on all 4 nodes), its progress, the
fetch, the export and the report with the Slurm job id and sacct's elapsed and CPU time."""

from __future__ import annotations

import json
import re
import time

import pytest
from harness import Cluster
from runner import TIMINGS, PlaybookRun, run_playbook

# Each node's CPUs in slurm.conf: ranks_per_node (the nodes share the host's cores, oversubscribed on purpose).
SLURM_CPUS = 4


@pytest.fixture(scope="module")
def slurm_cluster(cluster: Cluster, fresh_provision: PlaybookRun) -> Cluster:
    """The session's provisioned cluster, now also a Slurm cluster (its daemons stay until the session ends)."""
    if fresh_provision.rc != 0:
        pytest.fail(f"the fresh provision failed (rc={fresh_provision.rc}):\n{fresh_provision.tail()}")
    began = time.monotonic()
    cluster.start_slurm(SLURM_CPUS)
    TIMINGS.append(("Slurm daemons up on the test cluster", time.monotonic() - began))
    return cluster


def test_finetune_under_slurm_trains_16_ranks_and_reports_the_job(slurm_cluster: Cluster) -> None:
    runs = slurm_cluster.state_dir / "runs"
    began = time.monotonic()
    result = run_playbook(
        "finetune.yml",
        slurm_cluster.inventory,
        "-e",
        "finetune_launcher=slurm",
        "-e",
        "slurm_partition=xeonsd",
        "-e",
        f"controller_runs_dir={runs}",
        "-e",
        "finetune_run_id=slurm-e2e",
        "-e",
        "finetune_max_train_steps=10",
        state_dir=slurm_cluster.state_dir,
        name="finetune-slurm",
        timeout=1800,
    )
    TIMINGS.append(("finetune.yml under Slurm (train 16 ranks, export, 5 images, report)", time.monotonic() - began))
    assert result.rc == 0, result.tail()
    assert "node1: step " in result.output and " s/step" in result.output  # the progress lines, as under mpirun

    run = runs / "slurm-e2e"
    batch = (run / "job.sbatch").read_text()
    for option in ("--nodelist=node1,node2,node3,node4", "--ntasks-per-node=4", "--partition=xeonsd", "--signal=USR1@"):
        assert f"#SBATCH {option}" in batch, option
    assert "sbatch --parsable --wait job.sbatch" in (run / "run.sh").read_text()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 10 and {r["ranks"] for r in rows} == {16}
    train_log = (run / "train.log").read_text()
    for i in range(1, 5):
        assert f"node={slurm_cluster.address(i)} " in train_log, f"no rank ran on node{i}"
    assert re.search(r"^\[15\] ", train_log, re.MULTILINE), "rank lines are labelled as under mpirun -l"

    # The job's accounting, from sacct: slurm.json, run.json's cluster table, report.html.
    job = json.loads((run / "slurm.json").read_text())
    assert job["job_id"].isdigit() and job["state"] == "COMPLETED" and job["exit_code"] == 0, job
    assert job["elapsed_s"] > 0 and job["cpu_time_s"] > 0 and job["nodes"] == "node[1-4]", job
    sacct = slurm_cluster.ssh("node1", f"sacct -n -P -X -j {job['job_id']} -o JobID,State", user="devcloud")
    assert sacct.stdout.strip() == f"{job['job_id']}|COMPLETED"
    cluster = json.loads((run / "run.json").read_text())["cluster"]
    assert cluster["Slurm job"] == f"{job['job_id']} (COMPLETED, exit 0)"
    assert cluster["Slurm elapsed (s)"] == job["elapsed_s"] and cluster["Slurm CPU time (s)"] == job["cpu_time_s"]
    page = (run / "report.html").read_text()
    assert f"{job['job_id']} (COMPLETED, exit 0)" in page and "Slurm CPU time (s)" in page
    assert len(list((run / "images").glob("image_*.png"))) == 5
    print(f"\nSlurm job {job['job_id']}: elapsed {job['elapsed_s']} s, CPU time {job['cpu_time_s']} s")


def test_preflight_refuses_a_partition_slurm_does_not_have(slurm_cluster: Cluster, tmp_path) -> None:
    inventory = slurm_cluster.write_inventory(
        tmp_path / "inventory.yml", overrides={"finetune_launcher": "slurm", "slurm_partition": "gpu"}
    )
    result = run_playbook("provision.yml", inventory, state_dir=slurm_cluster.state_dir, name="preflight-slurm")
    assert result.rc != 0, result.tail()
    failures = result.failures()
    assert failures and all(f.task.startswith("preflight : ") for f in failures), failures
    said = " ".join(f.msg for f in failures)
    assert "Slurm has no partition gpu (its partitions: xeonsd). Fix: set slurm_partition to one of them." in said
    assert all(n == 0 for n in result.changed().values()), result.recap
