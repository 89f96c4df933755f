"""A job that was told to stop, as the files say it and the playbooks read it: the ranks' status files say
``interrupted`` with their Stop (xeonsd.contracts.job_status), exit.json takes rank 0's, the role's poll reports it
as a stop, not as a failure of some node (xeonsd.jobs.watch), and report.html says so first (xeonsd.ops.report)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from xeonsd.contracts import job_status as jobstatus
from xeonsd.contracts.job_status import RankStatus, StatusFileError, Stop
from xeonsd.jobs import attempts, slurm, watch
from xeonsd.jobs.status_file import RankStatusFile
from xeonsd.ops.report import build_report
from xeonsd.trainer.stopping import STOP_SIGNALS, exit_code, make_stop

NODES = [{"name": "node1", "address": "10.0.0.11"}, {"name": "node2", "address": "10.0.0.12"}]


def _rank_files(run: Path, world: int = 4, attempt: int = 1) -> list[RankStatusFile]:
    """Each rank's status file as the trainer starts it, node1 holding ranks 0-1 and node2 ranks 2-3 (one run
    directory stands for both nodes' copies)."""
    files = []
    for r in range(world):
        node = NODES[r // 2]
        status = RankStatus(r, world, node["name"], node["address"], 100 + r, "starting", 0, 1.0, attempt)
        files.append(RankStatusFile(run, status))
        files[-1].update(state="running", step=11)
    return files


def _statuses(run: Path) -> list[dict]:
    return watch.read_status_dir(str(run / jobstatus.STATUS_DIR))


def _poll_params(run: Path, tmp_path: Path, rc: int) -> dict:
    """The poll's (xeonsd.jobs.watch) parameters for one poll of ``run``, whose launcher's async result says ``rc``."""
    (tmp_path / "async").write_text(json.dumps({"rc": rc}))
    return {
        "run_dir": str(run),
        "results_file": str(tmp_path / "async"),
        "nodes": NODES,
        "ranks_per_node": 2,
        "total_steps": 100,
        "excerpt_lines": 12,
        "rank_status": _statuses(run),
    }


def test_every_rank_interrupted_is_reported_as_the_stop_with_its_step_and_what_to_do(tmp_path: Path) -> None:
    for f in _rank_files(tmp_path):
        f.interrupt(make_stop(15, 12, "checkpoint-12"))
    got = watch.diagnose(_statuses(tmp_path), NODES, 2, attempt=1)
    assert got["summary"] == "stopped by SIGTERM at step 12 (checkpoint-12 written); resume with -e resume=latest"
    assert got["stopped"] == {"signal": "SIGTERM", "reason": "signal", "step": 12, "checkpoint": "checkpoint-12"}
    assert got["nodes"] == [] and got["ranks"] == [], "a stop blames no node"
    status = jobstatus.read_rank_status(jobstatus.rank_status_path(tmp_path, 3))
    assert (status.state, status.step, status.stop) == (
        "interrupted",
        12,
        Stop("SIGTERM", "signal", 12, "checkpoint-12"),
    )


def test_the_time_limit_s_warning_is_reported_as_the_time_limit(tmp_path: Path) -> None:
    files = _rank_files(tmp_path)
    for f in files[:3]:  # rank 3 was ended before it could write: counted, the stop still reported
        f.interrupt(make_stop(10, 40, "checkpoint-40"))
    got = watch.diagnose(_statuses(tmp_path), NODES, 2, attempt=1)
    assert got["summary"] == (
        "stopped by the time limit at step 40 (checkpoint-40 written) (3/4 ranks recorded it); "
        "resume with -e resume=latest"
    )
    assert got["stopped"]["reason"] == "time_limit" and got["stopped"]["signal"] == "SIGUSR1"


def test_a_stop_before_the_first_step_says_nothing_was_saved(tmp_path: Path) -> None:
    for f in _rank_files(tmp_path):
        f.interrupt(make_stop(2, 0))
    got = watch.diagnose(_statuses(tmp_path), NODES, 2, attempt=1)
    assert got["summary"].startswith("stopped by SIGINT before the first training step; nothing of this attempt")


def test_a_rank_s_own_error_during_the_stop_is_a_failure_not_a_stop(tmp_path: Path) -> None:
    files = _rank_files(tmp_path)
    files[0].fail("exception", "OSError: [Errno 28] No space left on device (writing checkpoint-12)")
    for f in files[1:]:
        f.interrupt(make_stop(15, 12, "checkpoint-12"))
    got = watch.diagnose(_statuses(tmp_path), NODES, 2, attempt=1)
    assert "stopped" not in got and got["ranks"] == [0] and got["summary"].startswith("node1 (rank 0): failed")


def test_an_earlier_attempt_s_stop_is_not_this_attempt_s(tmp_path: Path) -> None:
    for f in _rank_files(tmp_path, attempt=1):
        f.interrupt(make_stop(15, 12, "checkpoint-12"))
    got = watch.diagnose(_statuses(tmp_path), NODES, 2, attempt=2)
    assert "stopped" not in got and got["summary"].startswith("unknown node: no rank of this attempt")


def test_exit_json_takes_rank_0_s_stop_of_this_attempt_and_the_poll_reports_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    attempts.begin_attempt(run, now=100, time_limit_s=60)
    for f in _rank_files(run):
        f.interrupt(make_stop(10, 40, "checkpoint-40"))
    ended = attempts.write_exit(run, 255, now=161)  # Hydra's code when its time limit ended the job
    assert ended.timed_out and ended.stopped == Stop("SIGUSR1", "time_limit", 40, "checkpoint-40")
    assert jobstatus.read_exit(run) == ended
    state = watch.job_state(_poll_params(run, tmp_path, rc=255))
    assert state["exit_code"] == 255 and state["failure"]["stopped"]["step"] == 40
    # Not "the job ran past its time limit; …": the stop says it.
    assert state["failure"]["summary"].startswith("stopped by the time limit at step 40"), state["failure"]
    # A finished attempt takes no stop: rank 0's file of this attempt says done.
    attempts.begin_attempt(run, now=200)
    assert attempts.write_exit(run, 0, now=230).stopped is None


def test_under_slurm_the_time_limit_stop_is_said_once_with_the_job_id(tmp_path: Path) -> None:
    """The ranks stopped on the batch job's warning (--signal=USR1@…) and srun exited 138: the poll says the stop
    the ranks recorded, once, with the Slurm job's id (not "stopped by the time limit" twice)."""
    from xeonsd.contracts import slurm_job

    run = tmp_path / "run"
    run.mkdir()
    attempts.begin_attempt(run, now=100, time_limit_s=120)
    for f in _rank_files(run):
        f.interrupt(make_stop(10, 40, "checkpoint-40"))
    attempts.write_exit(run, 138, now=161)
    job = slurm.parse_sacct("9|FAILED|138:0|61|1:00|244|node[1-2]|2\n", "9")
    jobstatus.write_json(run / slurm_job.SLURM_FILE, job.__dict__)
    assert watch.job_state(_poll_params(run, tmp_path, rc=138))["failure"]["summary"] == (
        "stopped by the time limit at step 40 (checkpoint-40 written); resume with -e resume=latest (Slurm job 9)"
    )


def test_report_html_says_first_that_the_run_was_stopped(tmp_path: Path) -> None:
    attempts.begin_attempt(tmp_path, now=100)
    for f in _rank_files(tmp_path):
        f.interrupt(make_stop(15, 12, "checkpoint-12"))
    attempts.write_exit(tmp_path, 143, now=150)
    page = build_report(tmp_path)
    stopped = (
        "<h2>Stopped</h2><p>Attempt 1 stopped by SIGTERM at step 12 (checkpoint-12 written); resume with -e "
        "resume=latest (exit code 143).</p>"
    )
    assert stopped in page and page.index(stopped) < page.index("<summary>Versions</summary>")
    attempts.begin_attempt(tmp_path, now=200)
    attempts.write_exit(tmp_path, 0, now=230)
    assert "<h2>Stopped</h2>" not in build_report(tmp_path), "a resumed run that finished is not reported stopped"


@pytest.mark.parametrize(
    "stop, why",
    [
        ({"signal": "SIGTERM", "reason": "preempted", "step": 3}, "stop reason 'preempted' is not one of"),
        ({"signal": "SIGTERM", "step": 3}, "stop must be an object with signal, reason, step"),
        ("SIGTERM", "stop must be an object with signal, reason, step"),
    ],
)
def test_a_status_file_with_a_broken_stop_is_refused_naming_it(stop: object, why: str) -> None:
    data = {
        **dict(rank=0, world=1, node="n", address="a", pid=1, state="interrupted", step=3, updated=1.0),
        "stop": stop,
        "schema": jobstatus.SCHEMA_VERSION,
    }
    with pytest.raises(StatusFileError, match=why):
        jobstatus.rank_status_from_dict(data, "rank 0")


def test_the_stop_s_exit_codes_are_the_ones_the_trainer_exits_with() -> None:
    """`xeonsd jobstatus codes` names them for the playbooks: 128 + the signal, as the trainer exits."""
    for sig in STOP_SIGNALS:
        assert jobstatus.EXIT_CODES[sig.name.lower()] == exit_code(sig) == 128 + sig


# ---- `xeonsd jobstatus stop` (the play's Ctrl-C): SIGTERM to the run's own run.sh, never to another process ----


def _start_run_sh(run: Path) -> subprocess.Popen:
    """A run.sh that writes its pid like the role's and exits 42 on SIGTERM."""
    (run / jobstatus.RUN_SCRIPT).write_text("echo $$ > run.pid\ntrap 'exit 42' TERM\nwhile :; do sleep 0.05; done\n")
    proc = subprocess.Popen(["/bin/bash", str(run / jobstatus.RUN_SCRIPT)], cwd=run)
    deadline = time.monotonic() + 30
    while not (run / jobstatus.RUN_PID_FILE).is_file() or not (run / jobstatus.RUN_PID_FILE).read_text().strip():
        assert time.monotonic() < deadline, "run.sh wrote no run.pid"
        time.sleep(0.02)
    return proc


def test_stop_sends_sigterm_to_the_run_s_own_run_sh(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    proc = _start_run_sh(run)
    try:
        answer = attempts.stop_job(run)
        assert answer["signalled"] and answer["pid"] == proc.pid, answer
        assert proc.wait(timeout=30) == 42
    finally:
        proc.kill()
    again = attempts.stop_job(run)
    assert not again["signalled"] and f"run.sh, pid {proc.pid}, is gone" in again["message"], again


def test_stop_signals_nothing_that_is_not_the_run_s_run_sh(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    assert "run.pid does not exist: the job never started" in attempts.stop_job(run)["message"]
    other = tmp_path / "other"
    other.mkdir()
    proc = _start_run_sh(other)  # another run's run.sh: a pid reused, or a run.pid copied
    try:
        (run / jobstatus.RUN_PID_FILE).write_text((other / jobstatus.RUN_PID_FILE).read_text())
        answer = attempts.stop_job(run)
        assert not answer["signalled"] and "is now another process" in answer["message"], answer
        assert proc.poll() is None, "another run's run.sh was signalled"
    finally:
        proc.kill()
        proc.wait()
    (run / jobstatus.RUN_PID_FILE).write_text("garbage\n")
    assert "holds no pid" in attempts.stop_job(run)["message"]
