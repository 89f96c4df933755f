"""slurm.json (xeonsd.contracts.slurm_job, read by xeonsd.jobs.slurm): sacct's lines as the Slurm test cluster
printed them, the time-limit stop, the wait for the final line, and run.json's cluster table with the job id and its
accounting."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from xeonsd.contracts import run_files, slurm_job
from xeonsd.contracts.job_status import StatusFileError, write_json
from xeonsd.jobs import attempts, slurm
from xeonsd.jobs.status_file import RankStatusFile

# sacct -n -P -j 12 -o JobID,State,ExitCode,ElapsedRaw,TotalCPU,CPUTimeRAW,NodeList,TimelimitRaw: the job's line,
# then its batch and srun steps (their CPU time is already in the job's TotalCPU).
SACCT = """\
12|COMPLETED|0:0|95|03:10.250|1520|node[1-4]|240
12.batch|COMPLETED|0:0|95|00:01.014|380|node1|
12.0|COMPLETED|0:0|93|03:09.236|1488|node[1-4]|
"""


def test_the_jobs_own_line_gives_its_accounting():
    job = slurm.parse_sacct(SACCT, "12")
    assert job == slurm_job.SlurmJob(
        job_id="12",
        state="COMPLETED",
        exit_code=0,
        elapsed_s=95,
        cpu_time_s=190.25,
        allocated_cpu_s=1520,
        nodes="node[1-4]",
        time_limit_s=14400,
        stopped_by_time_limit=False,
    )
    assert slurm.parse_sacct(SACCT, "13") is None


@pytest.mark.parametrize(
    ("state", "exit_code", "stopped"),
    [
        ("TIMEOUT", "0:15", True),  # Slurm ended it at the limit
        ("FAILED", "138:0", True),  # the ranks stopped on the warning signal (128 + SIGUSR1)
        ("CANCELLED by 1000", "0:15", False),
        ("FAILED", "1:0", False),
    ],
)
def test_a_time_limit_stop_is_told_apart(state, exit_code, stopped):
    job = slurm.parse_sacct(f"7|{state}|{exit_code}|60|00:30|240|node1|UNLIMITED\n", "7")
    assert job is not None and job.stopped_by_time_limit is stopped and job.time_limit_s is None
    assert job.state == state.split()[0]
    assert ("stopped by the time limit" in slurm.summary(job)) is stopped


def test_cpu_time_formats():
    assert slurm.cpu_seconds("00:00.030") == 0.03
    assert slurm.cpu_seconds("01:02:03") == 3723
    assert slurm.cpu_seconds("1-00:00:01") == 86401
    with pytest.raises(StatusFileError, match="TotalCPU 'soon'"):
        slurm.cpu_seconds("soon")


def test_query_waits_for_the_final_line_and_names_sacct_when_it_never_comes():
    answers = iter(["12|RUNNING|0:0|90|00:00:00|0|node[1-4]|240\n", SACCT])

    def sacct(argv, **_):
        assert argv[:5] == ["sacct", "-n", "-P", "-j", "12"]
        return subprocess.CompletedProcess(argv, 0, next(answers), "")

    assert slurm.query("12", wait_s=5, poll_s=0, run=sacct).state == "COMPLETED"

    def disabled(argv, **_):
        return subprocess.CompletedProcess(argv, 1, "", "Slurm accounting storage is disabled")

    began = time.monotonic()  # a cluster without accounting: said at once, not after waiting wait_s for nothing
    with pytest.raises(StatusFileError, match="accounting storage is disabled.*Fix: check that Slurm's accounting"):
        slurm.query("12", wait_s=60, poll_s=0, run=disabled)
    assert time.monotonic() - began < 30


SCONTROL = (
    "JobId=12 JobName=xeonsd-r1 UserId=devcloud(1000) JobState=TIMEOUT Reason=TimeLimit ExitCode=0:15 "
    "RunTime=00:04:05 TimeLimit=00:04:00 NodeList=node[1-4] NumNodes=4 NumCPUs=16 Command=/home/devcloud/run.sh\n"
)


def test_without_accounting_the_job_comes_from_scontrol_and_its_cpu_time_is_said_to_be_unknown(tmp_path):
    asked = []

    def no_accounting(argv, **_):
        asked.append(argv[0])
        if argv[0] == "sacct":
            return subprocess.CompletedProcess(argv, 1, "", "sacct: error: Slurm accounting storage is disabled")
        assert argv == ["scontrol", "show", "job", "-o", "12"]
        return subprocess.CompletedProcess(argv, 0, SCONTROL, "")

    job = slurm.query("12", wait_s=60, poll_s=0, run=no_accounting)
    assert asked == ["sacct", "scontrol"]
    assert (job.state, job.exit_code, job.elapsed_s, job.time_limit_s, job.nodes) == (
        "TIMEOUT",
        0,
        245,
        240,
        "node[1-4]",
    )
    assert job.cpu_time_s is None and job.allocated_cpu_s == 16 * 245 and job.source == "scontrol"
    assert job.stopped_by_time_limit
    assert "CPU time not recorded (no Slurm accounting) of 3920 s allocated" in slurm.summary(job)
    write_json(tmp_path / slurm_job.SLURM_FILE, job.__dict__)
    facts = {"run": "r1", "nodes": ["node1"], "mpi_ranks": 4, "ranks_per_node": 4, "primary": "node1"}
    assert run_files.run_json(tmp_path, facts)["cluster"]["Slurm CPU time (s)"] == "not recorded (no Slurm accounting)"
    assert slurm.parse_scontrol(SCONTROL.replace("TIMEOUT", "RUNNING"), "12") is None  # not ended yet
    assert slurm.parse_scontrol(SCONTROL, "13") is None  # another job


def test_run_json_shows_the_slurm_job(tmp_path):
    facts = {"run": "r1", "nodes": ["node1"], "mpi_ranks": 4, "ranks_per_node": 4, "primary": "node1"}
    assert "launcher" not in run_files.run_json(tmp_path, facts)["cluster"]  # an mpirun run: no Slurm rows
    job = slurm.parse_sacct(SACCT, "12")
    write_json(tmp_path / slurm_job.SLURM_FILE, job.__dict__)
    assert slurm_job.read_slurm_job(tmp_path) == job
    info = run_files.run_json(tmp_path, facts)
    assert info["cluster"]["Slurm job"] == "12 (COMPLETED, exit 0)"
    assert info["cluster"]["Slurm elapsed (s)"] == 95 and info["cluster"]["Slurm CPU time (s)"] == 190.25
    assert info["slurm"]["job_id"] == "12"
    (tmp_path / slurm_job.SLURM_FILE).write_text('{"schema": 0}')
    with pytest.raises(StatusFileError, match="not a slurm.json of schema 1"):
        run_files.run_json(tmp_path, facts)


def test_a_job_stopped_by_the_slurm_time_limit_is_named_with_its_step(tmp_path):
    """The poll's failure for a job Slurm stopped at its limit says so, with the step reached and the resume hint."""
    from xeonsd.jobs import watch

    run = tmp_path / "run"
    run.mkdir()
    attempts.begin_attempt(run, now=1, time_limit_s=600)
    attempts.write_exit(run, 138, now=300)
    (run / "metrics.partial.jsonl").write_text(json.dumps({"step": 7, "loss": 0.5, "s_per_step": 2.0}) + "\n")
    job = slurm.parse_sacct("9|FAILED|138:0|299|10:00|1196|node[1-4]|10\n", "9")
    write_json(run / slurm_job.SLURM_FILE, job.__dict__)
    results = tmp_path / "async"
    results.write_text(json.dumps({"rc": 138}))
    params = {
        "run_dir": str(run),
        "results_file": str(results),
        "nodes": [{"name": "node1", "address": "10.0.0.11"}],
        "ranks_per_node": 4,
        "total_steps": 30,
        "excerpt_lines": 5,
        "rank_status": [],
    }
    summary = watch.job_state(params)["failure"]["summary"]
    assert summary.startswith(
        "stopped by the time limit at step 7 (Slurm job 9, FAILED); resume with -e resume=latest; "
    ), summary
    (run / slurm_job.SLURM_FILE).unlink()  # the same failure of an mpirun job: no Slurm words
    assert "Slurm" not in watch.job_state(params)["failure"]["summary"]


def test_a_node_whose_tasks_srun_reports_first_is_named_when_no_rank_could_say(tmp_path):
    """Under Slurm, srun --kill-on-bad-exit ends every rank as soon as one node's tasks die: no status file names
    a lost peer, and srun's first line names the node (its later lines, for the ranks it ended, do not count)."""
    from xeonsd.contracts import job_status
    from xeonsd.jobs import watch

    nodes = [{"name": f"node{i}", "address": f"10.0.0.1{i}"} for i in range(1, 5)]
    for r in range(16):
        node = nodes[r // 4]
        status = job_status.RankStatus(r, 16, node["name"], node["address"], 100 + r, "starting", 0, 1.0, 1)
        RankStatusFile(tmp_path, status).update(state="running", step=3)
    log = "\n".join(
        [
            "[0] step 3 loss 0.1",
            "srun: error: node3: tasks 8-11: Killed",
            "srun: Job step aborted: Waiting up to 32 seconds for job step to finish.",
            "srun: error: node1: tasks 0-3: Killed",
            "srun: error: node2: tasks 4-7: Killed",
        ]
    )
    statuses = watch.read_status_dir(str(tmp_path / job_status.STATUS_DIR))
    got = watch.diagnose(statuses, nodes, 4, attempt=1, log_text=log)
    assert got["nodes"] == ["node3"] and got["ranks"] == [8, 9, 10, 11], got
    assert "srun: error: node3: tasks 8-11: Killed" in got["excerpt"]


def test_the_ranks_time_limit_stop_makes_the_job_stopped_by_the_time_limit_whatever_srun_returned(tmp_path):
    """Seen on the test cluster: the ranks stopped on the warning (exit 138), srun returned 15 (its
    --kill-on-bad-exit sent the last ranks SIGTERM), sacct says FAILED 15: slurm.json still says the time limit."""
    from xeonsd.contracts import job_status
    from xeonsd.trainer.stopping import make_stop

    attempts.begin_attempt(tmp_path, now=1, time_limit_s=360)
    status = job_status.RankStatus(0, 1, "node1", "10.0.0.11", 100, "starting", 0, 1.0, 1)
    RankStatusFile(tmp_path, status).interrupt(make_stop(10, 60, "checkpoint-60"))
    attempts.write_exit(tmp_path, 15, now=331)
    line = "2|FAILED|15:0|331|02:44.838|5296|node[1-4]|6\n"

    def sacct(argv, **_):
        return subprocess.CompletedProcess(argv, 0, line, "")

    job = slurm.record(tmp_path, "2", wait_s=0, run=sacct)
    assert job.stopped_by_time_limit and job.exit_code == 15
    assert json.loads((tmp_path / slurm_job.SLURM_FILE).read_text())["stopped_by_time_limit"] is True
    attempts.begin_attempt(tmp_path, now=400)  # an attempt that failed on its own: no time limit
    attempts.write_exit(tmp_path, 15, now=431)
    assert not slurm.record(tmp_path, "2", wait_s=0, run=sacct).stopped_by_time_limit
