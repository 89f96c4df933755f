"""Slurm on the test cluster, built by the slurm role (provision.yml with slurm_install: true, run twice: the second
run changes nothing), then finetune.yml with finetune_launcher=slurm on it: an 8-rank job (2 per node) as one batch job (sbatch
from the primary, the ranks srun's tasks on all 4 nodes), its progress, the fetch, the export and the report with
the Slurm job id and sacct's elapsed and CPU time (the site's accounting: the harness's slurmdbd on the host, named
in slurm_conf_extra_lines); the failure paths under Slurm."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from harness import Cluster
from jobs import RUNS, all_job_processes, background_playbook, finish, job_processes, latest_step, wait_for
from runner import TIMINGS, PlaybookRun, run_playbook

# The slurm role's settings on the test cluster (each node's CPUs in slurm.conf: ranks_per_node, the nodes share
# the host's cores, oversubscribed on purpose).
ROLE_VARS = Path(__file__).resolve().parent / "slurm_role_vars.yml"


@pytest.fixture(scope="module")
def slurm_role(cluster: Cluster, fresh_provision: PlaybookRun) -> tuple[PlaybookRun, tuple[str, ...]]:
    """The slurm role's first run on the session's provisioned cluster (provision.yml --tags slurm with
    slurm_role_vars.yml), pointed at the site's accounting that the harness starts first (MariaDB and slurmdbd on
    the host). Returns the run and its arguments. The daemons stay until the session ends (`down` stops them: the
    accounting's recorded here, the role's found from their pid files)."""
    if fresh_provision.rc != 0:
        pytest.fail(f"the fresh provision failed (rc={fresh_provision.rc}):\n{fresh_provision.tail()}")
    began = time.monotonic()
    accounting = cluster.slurm
    try:
        lines = accounting.start_accounting(slurm_user="slurm")
    finally:
        cluster.record({f"slurm-{name}": pid for name, pid in accounting.pids.items()})
    TIMINGS.append(("Slurm's accounting up on the host (MariaDB, slurmdbd)", time.monotonic() - began))
    args = ("--tags", "slurm", "-e", f"@{ROLE_VARS}", "-e", json.dumps({"slurm_conf_extra_lines": lines}))
    first = run_playbook("provision.yml", cluster.inventory, *args, state_dir=cluster.state_dir, name="slurm-role")
    if first.rc != 0:
        pytest.fail(f"provision.yml with slurm_install: true failed (rc={first.rc}):\n{first.tail()}")
    return first, args


def _node_states(cluster: Cluster) -> dict[str, str]:
    out = cluster.ssh("node1", "sinfo -h -N -p xeonsd -o '%N %t'", check=False).stdout
    return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)


@pytest.fixture(scope="module")
def slurm_cluster(cluster: Cluster, slurm_role: tuple[PlaybookRun, tuple[str, ...]]) -> Cluster:
    """The session's provisioned cluster, now a Slurm cluster made by the slurm role, its 4 nodes idle."""
    wait_for(lambda: set(_node_states(cluster).values()) == {"idle"}, 60, "the 4 Slurm nodes idle")
    return cluster


def test_provision_with_slurm_install_makes_a_slurm_cluster_and_a_second_run_changes_nothing(
    slurm_role: tuple[PlaybookRun, tuple[str, ...]], slurm_cluster: Cluster
) -> None:
    first, args = slurm_role
    assert all(n > 0 for n in first.changed().values()), first.recap  # it configured every node
    second = run_playbook(
        "provision.yml", slurm_cluster.inventory, *args, state_dir=slurm_cluster.state_dir, name="slurm-role-second"
    )
    assert second.rc == 0, second.tail()
    assert second.changed() == {node: 0 for node in slurm_cluster.nodes}, second.recap
    assert _node_states(slurm_cluster) == {node: "idle" for node in slurm_cluster.nodes}
    # One task on each node, each in its node's namespace (its own address), started by the role's slurmd there.
    out = slurm_cluster.ssh(
        "node1", "srun -N4 -n4 -l sh -c 'echo $SLURMD_NODENAME $(hostname -I)'", user="devcloud", timeout=120
    ).stdout
    tasks = sorted(tuple(line.split()[1:]) for line in out.splitlines() if line.strip())
    assert tasks == [(f"node{i}", slurm_cluster.address(i)) for i in range(1, 5)], out


def test_finetune_under_slurm_trains_8_ranks_and_reports_the_job(slurm_cluster: Cluster) -> None:
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
        # Two ranks per node: srun's tasks several to a node, as the recipe's 4 are (the 16-rank start is
        # test_finetune_e2e.py's; on 2 cores 8 ranks reach their first step in about a quarter of its time).
        *("-e", "ranks_per_node=2", "-e", "mpi_ranks=8"),
        state_dir=slurm_cluster.state_dir,
        name="finetune-slurm",
        timeout=1800,
    )
    TIMINGS.append(("finetune.yml under Slurm (train 8 ranks, export, 5 images, report)", time.monotonic() - began))
    assert result.rc == 0, result.tail()
    assert "node1: step " in result.output and " s/step" in result.output  # the progress lines, as under mpirun

    run = runs / "slurm-e2e"
    batch = (run / "job.sbatch").read_text()
    for option in ("--nodelist=node1,node2,node3,node4", "--ntasks-per-node=2", "--partition=xeonsd", "--signal=USR1@"):
        assert f"#SBATCH {option}" in batch, option
    assert "sbatch --parsable --wait job.sbatch" in (run / "run.sh").read_text()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 10 and {r["ranks"] for r in rows} == {8}
    train_log = (run / "train.log").read_text()
    for i in range(1, 5):
        assert f"node={slurm_cluster.address(i)} " in train_log, f"no rank ran on node{i}"
    assert re.search(r"^\[7\] ", train_log, re.MULTILINE), "rank lines are labelled as under mpirun -l"

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


# ---- the failure paths under Slurm: one run, killed, stopped by its time limit, then by a Ctrl-C ----------------
# A node's rank killed mid-job ends the job and the play names the node; the same run resumed, its time limit
# reached, stops on the batch job's warning signal at a step with a checkpoint and says so; resumed again, a Ctrl-C
# on the play stops it at a step with a checkpoint (SIGTERM through run.sh and scancel) and the play says so. Three
# job runs of one run directory, each from what the one before left. That a run resumed from such a checkpoint
# trains to its end is the mpirun chain's last attempt (test_finetune_recovery.py): resuming is the trainer's, whatever
# launched it, and the Ctrl-C's checkpoint is a SIGTERM's.
# One rank per node (4 ranks on the 4 nodes): what these prove is about nodes and the batch job, not the rank count
# (the 8-rank job is the test above), and on 2 cores four ranks start faster than eight.
LIMITED = "slurm-limits"
LIMITED_STEPS = 400  # never reached: the kill, the time limit and the Ctrl-C end the three attempts
# The time-limited attempt: --time and --signal=USR1@WARNING_S from the inventory's variables. Once it trains,
# the test brings the job's end to WARNING_S + 3..63 s from now (scontrol update TimeLimit, in Slurm's whole
# minutes): slurmctld, which checks the limits about every 30 s, then sends the warning within about a minute, and
# the ranks have WARNING_S for the step in progress and the checkpoint. (A limit given at the start would have to
# outlast a start-up that takes 30 s on a quiet machine and minutes on a busy one.)
TIME_LIMIT_S = 1200
WARNING_S = 60


def _limited_args(runs: Path, *extra: str) -> tuple[str, ...]:
    # a table: each -e beside its value (ruff would put one item per line)
    return (
        "-e", "finetune_launcher=slurm", "-e", "slurm_partition=xeonsd", "-e", f"controller_runs_dir={runs}",
        "-e", f"finetune_run_id={LIMITED}", "-e", "finetune_checkpointing_steps=2", "-e", "ranks_per_node=1",
        "-e", "mpi_ranks=4", "--tags", "finetune", *extra,
    )  # fmt: skip


def _slurm_jobs(cluster: Cluster) -> str:
    return cluster.ssh("node1", "squeue -h -o %i", user="devcloud", check=False).stdout.strip()


def test_a_node_killed_under_slurm_ends_the_job_and_the_play_names_it(slurm_cluster: Cluster) -> None:
    runs = slurm_cluster.state_dir / "runs"
    args = _limited_args(runs, "-e", f"finetune_max_train_steps={LIMITED_STEPS}")
    with background_playbook(slurm_cluster, "finetune-slurm-killed", "finetune.yml", *args) as (job, log, _):
        wait_for(lambda: latest_step(slurm_cluster) >= 3, 900, "step 3 (checkpoint-2 exists)", job, log)
        victims = job_processes(slurm_cluster, "node3")
        assert victims, "no training process on node3"
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: not all_job_processes(slurm_cluster) and not _slurm_jobs(slurm_cluster), 120, "the job's end")
        job_ended = time.monotonic() - killed
        rc = finish(job, timeout=300)
    output = log.read_text()
    print(f"\nnode3's ranks killed under Slurm: the Slurm job ended {job_ended:.1f} s later")
    assert rc != 0
    failure = output[output.index("Training failed:") :]
    assert failure.startswith("Training failed: node3 (rank 2)"), failure[:2000]
    assert "resume=latest" in failure
    job_info = json.loads(slurm_cluster.ssh("node1", f"cat {RUNS}/{LIMITED}/slurm.json").stdout)
    assert job_info["state"] == "FAILED" and not job_info["stopped_by_time_limit"], job_info


def _bring_the_end_near(cluster: Cluster, job_id: str) -> None:
    """The running job's time limit cut to end WARNING_S + 3..63 s from now (root is Slurm's admin here)."""
    used = cluster.ssh("node1", f"squeue -h -j {job_id} -o %M").stdout.strip()
    parts = [int(x) for x in re.split(r"[-:]", used)]
    elapsed = sum(p * m for p, m in zip(reversed(parts), (1, 60, 3600, 86400), strict=False))
    minutes = -(-(elapsed + WARNING_S + 3) // 60)
    cluster.ssh("node1", f"scontrol update JobId={job_id} TimeLimit={minutes}")


def _stop_at_the_time_limit(cluster: Cluster, runs: Path) -> tuple[int, str]:
    """The resumed attempt, its time limit brought near once it trains: the step it stopped at and its job id."""
    # a table: each -e beside its value (ruff would put one item per line)
    args = _limited_args(
        runs, "-e", "resume=latest", "-e", f"finetune_max_train_steps={LIMITED_STEPS}",
        "-e", f"finetune_timeout_s={TIME_LIMIT_S}", "-e", f"finetune_slurm_signal_s={WARNING_S}",
    )  # fmt: skip
    before = latest_step(cluster)
    with background_playbook(cluster, "finetune-slurm-time-limit", "finetune.yml", *args) as (job, log, began):
        wait_for(lambda: latest_step(cluster) > before, 900, f"a step past {before}", job, log)
        job_id = cluster.ssh("node1", f"cat {RUNS}/{LIMITED}/slurm-job-id").stdout.strip()
        _bring_the_end_near(cluster, job_id)
        rc = finish(job, timeout=600)
        TIMINGS.append(("finetune.yml under Slurm stopped by its time limit", time.monotonic() - began))
    output = log.read_text()
    assert rc != 0
    said = re.search(
        r"Training stopped by the time limit at step (\d+) \(checkpoint-(\d+) written\); resume with -e "
        r"resume=latest \(Slurm job (\d+)\)",
        output,
    )
    assert said and said[1] == said[2] and said[3] == job_id, output[-6000:]
    return int(said[1]), job_id


def _stopped_by_ctrl_c(cluster: Cluster, runs: Path, checkpoint: int) -> int:
    """Attempt 3 resumes from the time limit's checkpoint; once it trains a step past it, a Ctrl-C on the play
    (SIGINT to its process group, as a terminal sends it). The play goes on: its next poll sends run.sh SIGTERM,
    which passes it to the job's step (scancel --signal=TERM), every rank stops after the same step, rank 0 writes a
    checkpoint, and the play fails saying so, with the report. Returns that step."""
    args = _limited_args(runs, "-e", "resume=latest", "-e", f"finetune_max_train_steps={LIMITED_STEPS}")
    with background_playbook(cluster, "finetune-slurm-ctrl-c", "finetune.yml", *args) as (job, log, began):
        wait_for(lambda: latest_step(cluster) > checkpoint, 900, f"a step past {checkpoint}", job, log)
        job_id = cluster.ssh("node1", f"cat {RUNS}/{LIMITED}/slurm-job-id").stdout.strip()
        os.killpg(job.pid, signal.SIGINT)
        rc = finish(job, timeout=300)
        TIMINGS.append(("finetune.yml under Slurm stopped by a Ctrl-C on the play", time.monotonic() - began))
    output = log.read_text()
    assert rc != 0
    assert "[xeonsd] Ctrl-C: stopping the training job cleanly" in output, output[-6000:]
    assert "node1: SIGTERM sent to the job (run.sh, pid " in output, output[-6000:]
    said = re.search(
        r"Training stopped by SIGTERM at step (\d+) \(checkpoint-(\d+) written\); resume with -e resume=latest", output
    )
    assert said and said[1] == said[2] and int(said[1]) > checkpoint, output[-6000:]
    step = int(said[1])
    assert not _slurm_jobs(cluster), "the Slurm job outlived its ranks"
    for node, rank in (("node1", 0), ("node4", 3)):
        status = json.loads(cluster.ssh(node, f"cat {RUNS}/{LIMITED}/status/rank-{rank}.json").stdout)
        assert (status["state"], status["step"], status["stop"]["signal"]) == ("interrupted", step, "SIGTERM"), status
    cluster.ssh("node1", f"test -f {RUNS}/{LIMITED}/checkpoint-{step}/trainer_state.pt")
    job_info = json.loads((runs / LIMITED / "slurm.json").read_text())
    assert job_info["job_id"] == job_id and not job_info["stopped_by_time_limit"], job_info
    assert f"stopped by SIGTERM at step {step}" in (runs / LIMITED / "report.html").read_text()
    return step


def test_the_time_limit_and_a_ctrl_c_under_slurm_stop_at_a_step_with_a_checkpoint(
    slurm_cluster: Cluster,
) -> None:
    runs = slurm_cluster.state_dir / "runs"
    step, job_id = _stop_at_the_time_limit(slurm_cluster, runs)
    print(f"\nSlurm job {job_id} stopped by its time limit at step {step}")
    batch = (runs / LIMITED / "job.sbatch").read_text()
    assert "#SBATCH --time=0:20:00" in batch and f"#SBATCH --signal=USR1@{WARNING_S}" in batch
    slurm_cluster.ssh("node1", f"test -f {RUNS}/{LIMITED}/checkpoint-{step}/trainer_state.pt")
    job_info = json.loads((runs / LIMITED / "slurm.json").read_text())
    assert job_info["job_id"] == job_id and job_info["stopped_by_time_limit"], job_info
    assert job_info["state"] != "TIMEOUT", "the ranks stopped on the warning, before Slurm had to end them"
    page = (runs / LIMITED / "report.html").read_text()
    assert f"stopped by the time limit at step {step}" in page

    step = _stopped_by_ctrl_c(slurm_cluster, runs, step)
    print(f"Ctrl-C on the play: the Slurm job's ranks stopped at step {step}")
    # Three attempts of one run directory, each from the checkpoint the one before left; the steps logged so far
    # are one sequence (nothing trained twice, nothing skipped), as a resumed run's must be.
    rows = [json.loads(x) for x in (runs / LIMITED / "metrics.partial.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, step + 1)), [r["step"] for r in rows]
    assert json.loads((runs / LIMITED / "exit.json").read_text())["attempt"] == 3
