"""What the finetune role's job module answers (xeonsd.jobs.watch, `xeonsd jobstatus poll`): progress from the
trainer's metrics, and which node a failed job blames.

Who failed comes from the ranks' status files, written here with the package's own writers (xeonsd.jobs.status_file,
xeonsd.jobs.attempts) into one directory per node, and read back as the role gathers them (read_status_dir on each node); the excerpt
comes from train.log, in the shape `mpirun -l` gives the trainer's output (every line prefixed with its rank)."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import threading
import time
from pathlib import Path

import pytest

from xeonsd.contracts.job_status import LastError, RankStatus
from xeonsd.jobs import attempts, watch
from xeonsd.jobs.status_file import RankStatusFile

NODES = [{"name": f"node{i}", "address": f"10.0.0.{10 + i}"} for i in range(1, 5)]
LOST = "the all-reduce failed: a peer rank died, its node went away or it stalled past the collective timeout"


def _statuses(
    tmp: Path,
    errors: dict[int, LastError] | None = None,
    world: int = 16,
    ppn: int = 4,
    attempt: int | None = 1,
    state: str = "running",
    only: range | None = None,
) -> list[dict]:
    """Each rank's status file written by the package on its node's disk (tmp/nodeN/run), as the role gathers
    them: every node's status directory read by read_status_dir. ``errors``: the ranks that failed, and how."""
    errors = errors or {}
    for r in only if only is not None else range(world):
        node = NODES[r // ppn]
        status = RankStatus(
            rank=r,
            world=world,
            node=node["name"],
            address=node["address"],
            pid=100 + r,
            state="starting",
            step=0,
            updated=1.0,
            attempt=attempt,
        )
        writer = RankStatusFile(tmp / node["name"] / "run", status)
        writer.update(state=state, step=7)
        if r in errors:
            writer.fail(errors[r].kind, errors[r].message, errors[r].peer)
    return [s for n in NODES for s in watch.read_status_dir(str(tmp / n["name"] / "run" / "status"))]


def _startup(world: int = 16, ppn: int = 4) -> list[str]:
    return [
        f"[{r}] 2026-11-30 10:00:00,000 [rank {r}/{world}] INFO xeonsd.train: node=10.0.0.{11 + r // ppn} pid={100 + r} "
        "launcher=intel-mpi backend=gloo threads=1"
        for r in range(world)
    ]


def test_a_node_whose_ranks_fail_with_their_own_error_is_named_with_its_error_lines(tmp_path: Path) -> None:
    errors = {r: LastError("input", "no images found in /home/devcloud/dicoo") for r in (8, 9, 10, 11)}
    errors[0] = LastError("lost_peer", f"{LOST} (Connection closed by peer [10.0.0.13]:4000)", "10.0.0.13")
    log = "\n".join(
        [
            "#### xeonsd attempt 1 started 2026-11-30T10:00:00Z on node1",
            *[
                f"[{r}] xeonsd train: error: rank {r}/16 on 10.0.0.13: no images found in /home/devcloud/dicoo"
                for r in (8, 9, 10, 11)
            ],
        ]
    )
    got = watch.diagnose(_statuses(tmp_path, errors), NODES, 4, attempt=1, log_text=log)
    assert got["nodes"] == ["node3"] and got["ranks"] == [8, 9, 10, 11]
    assert got["summary"].startswith("node3 (ranks 8-11): failed with an error")
    assert (
        got["excerpt"][0]
        == "[rank 8] xeonsd train: error: rank 8/16 on 10.0.0.13: no images found in /home/devcloud/dicoo"
    )
    # No log (or not their lines in it): the excerpt is what their status files say.
    got = watch.diagnose(_statuses(tmp_path, errors), NODES, 4, attempt=1)
    assert (
        got["ranks"] == [8, 9, 10, 11]
        and got["excerpt"][0] == "[rank 8] input: no images found in /home/devcloud/dicoo"
    )


def test_who_failed_comes_from_the_status_files_not_the_log(tmp_path: Path) -> None:
    """A log that blames node1 changes nothing: the status files say node2's rank 5 raised."""
    log = "[0] xeonsd train: error: rank 0/16 on 10.0.0.11: no images found\n[0] Traceback (most recent call last):"
    got = watch.diagnose(
        _statuses(tmp_path, {5: LastError("exception", "RuntimeError: boom")}), NODES, 4, attempt=1, log_text=log
    )
    assert got["nodes"] == ["node2"] and got["ranks"] == [5]
    assert got["excerpt"] == ["[rank 5] exception: RuntimeError: boom"]


def test_a_killed_node_is_the_silent_one_its_peers_name(tmp_path: Path) -> None:
    errors = {
        4: LastError("lost_peer", f"{LOST} (Read error [10.0.0.13]:51234: Connection reset by peer)", "10.0.0.13"),
        12: LastError("lost_peer", f"{LOST} (Connection closed by peer [10.0.0.13]:51777)", "10.0.0.13"),
    }
    got = watch.diagnose(_statuses(tmp_path, errors), NODES, 4, attempt=1, log_text="\n".join(_startup()))
    assert got["nodes"] == ["node3"] and got["ranks"] == [8, 9, 10, 11]
    assert got["summary"] == (
        "node3 (ranks 8-11): stopped without an error of their own (killed, crashed hard or stalled; or their node "
        "went away); 2 other rank(s) reported losing them"
    )
    assert any("Connection reset by peer" in line for line in got["excerpt"])
    assert "[rank 8] last line: " in got["excerpt"][0]


def test_a_dead_node_that_left_no_status_file_is_still_named(tmp_path: Path) -> None:
    """node3 went away whole: its status files could not be read (unreachable), its peers name it."""
    errors = {r: LastError("lost_peer", f"{LOST} ([10.0.0.13]:1)", "10.0.0.13") for r in (4, 7)}
    statuses = [s for s in _statuses(tmp_path, errors) if s["node"] != "node3"]
    got = watch.diagnose(statuses, NODES, 4, attempt=1)
    assert got["nodes"] == ["node3"] and got["ranks"] == [8, 9, 10, 11]


def test_a_stalled_node_is_the_one_that_did_not_time_out(tmp_path: Path) -> None:
    lost = f"{LOST} (no answer within 45 s)"
    errors = {r: LastError("timeout", lost) for r in range(16) if r // 4 != 1}
    got = watch.diagnose(_statuses(tmp_path, errors), NODES, 4, attempt=1)
    assert got["nodes"] == ["node2"] and got["ranks"] == [4, 5, 6, 7]


def test_only_the_newest_attempt_counts(tmp_path: Path) -> None:
    old = _statuses(tmp_path / "a1", {8: LastError("input", "no images found")}, attempt=1)
    new = _statuses(tmp_path / "a2", {2: LastError("input", "checkpoint is unreadable")}, attempt=2)
    got = watch.diagnose(old + new, NODES, 4, attempt=2)
    assert got["nodes"] == ["node1"] and got["ranks"] == [2]


def test_no_status_file_at_all_says_the_job_did_not_start_and_shows_the_log(tmp_path: Path) -> None:
    log = "#### xeonsd attempt 1\n[mpiexec@node1] HYDU_sock_connect: unable to connect from node1 to node3"
    got = watch.diagnose([], NODES, 4, attempt=1, log_text=log)
    assert got["nodes"] == [] and got["ranks"] == []
    assert (
        got["summary"]
        == "unknown node: no rank of this attempt wrote its status file (the job did not start: see its log)"
    )
    assert got["excerpt"][-1].endswith("unable to connect from node1 to node3")


def test_a_status_file_of_another_schema_or_not_json_is_reported(tmp_path: Path) -> None:
    statuses = _statuses(tmp_path, {9: LastError("input", "bad")})
    (tmp_path / "node1" / "run" / "status" / "rank-0.json").write_text('{"rank": 0, "sta')
    statuses = [s for n in NODES for s in watch.read_status_dir(str(tmp_path / n["name"] / "run" / "status"))]
    statuses[1] = {**statuses[1], "schema": 99}
    got = watch.diagnose(statuses, NODES, 4, attempt=1)
    assert got["ranks"] == [9] and got["summary"].endswith("; 2 status file(s) could not be read")
    assert any("rank-0.json: unreadable" in line for line in got["excerpt"])
    assert any("schema 99, this role reads schema 1" in line for line in got["excerpt"])


def test_progress_line_and_job_state(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "loss": 0.5 / s, "s_per_step": 2.0, "ranks": 16, "backend": "gloo"} for s in range(1, 51)]
    (run / "metrics.partial.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 51, "lo')
    results = tmp_path / "async"
    results.write_text(json.dumps({"started": 1, "finished": 0}))
    params = {
        "run_dir": str(run),
        "results_file": str(results),
        "nodes": NODES,
        "ranks_per_node": 4,
        "total_steps": 200,
        "excerpt_lines": 5,
    }
    state = watch.job_state(params)
    assert not state["finished"]
    assert state["msg"] == "step 50/200 (25%) · loss 0.0100 · 2.00 s/step · ~5m 00s left · 16 ranks (gloo)"
    # The last step is logged: the job is still saving the embedding and the pipeline, not stuck at ~0s left.
    assert watch.job_state({**params, "total_steps": 50})["msg"] == (
        "step 50/50 (100%) · loss 0.0100 · 2.00 s/step · saving the outputs · 16 ranks (gloo)"
    )

    # The job ended: exit.json (run.sh's `xeonsd jobstatus exit`) gives the rc; the status files who failed: the
    # gathered ones when given, else the primary's own.
    assert attempts.begin_attempt(run, now=1).attempt == 1
    results.write_text(json.dumps({"rc": 2, "cmd": ["flock"]}))
    attempts.write_exit(run, 2, now=61)
    gathered = _statuses(tmp_path / "nodes", {5: LastError("input", "the model is missing")})
    state = watch.job_state({**params, "rank_status": gathered})
    assert state["finished"] and state["exit_code"] == 2 and state["exit"]["ended"] - state["exit"]["started"] == 60
    assert state["failure"]["nodes"] == ["node2"]
    RankStatusFile(
        run,
        RankStatus(
            rank=0,
            world=16,
            node="node1",
            address="10.0.0.11",
            pid=1,
            state="failed",
            step=3,
            updated=2.0,
            attempt=1,
            error=LastError("input", "--resolution 100"),
        ),
    )
    state = watch.job_state(params)
    assert state["failure"]["nodes"] == ["node1"] and state["failure"]["ranks"] == [0]

    # The lock was taken between the check and the launch: flock's own exit code.
    (run / "exit.json").unlink()
    results.write_text(json.dumps({"rc": 75}))
    state = watch.job_state(params)
    assert state["exit_code"] == 75 and "holds the lock" in state["failure"]["summary"]

    # An exit.json of another schema is an error that says so, not a guess.
    (run / "exit.json").write_text(json.dumps({"rc": 2, "started": 1, "ended": 61}))
    with pytest.raises(ValueError, match="schema None, this role reads schema 1"):
        watch.job_state(params)


def _stats_rows(slow_node: int | None, all_low: bool = False) -> list[dict]:
    """Metrics rows as the trainer writes them (xeonsd.cluster.rank_stats), 16 ranks on 4 nodes, stats every 5 steps;
    ``all_low``: every node at 11 % CPU on one 2-core machine (the demo on the test cluster)."""
    from xeonsd.cluster.rank_stats import Interval, StragglerWatch, summarize

    judge = StragglerWatch(shared_cores=2 if all_low else 0)
    rows = []
    for step in range(1, 21):
        row = {"step": step, "loss": 0.1, "s_per_step": 3.2, "ranks": 16, "backend": "gloo"}
        if step % 5 == 0:
            ivs = []
            for r in range(16):
                slow = r // 4 + 1 == slow_node
                compute, allreduce, util = (3.0, 0.1, 0.56) if slow else (2.0, 1.1, 0.11 if all_low else 0.96)
                wall = 5 * (compute + allreduce + 0.1)
                threads, cores = (1, 2) if all_low else (4, 0)
                ivs.append(Interval(5, wall, util * wall * threads, threads, 0.5, 5 * allreduce, cores))
            summary = summarize(ivs, [f"node{r // 4 + 1}" for r in range(16)])
            row |= {"rank_stats": summary, **judge.verdict(summary)}
        rows.append(row)
    return rows


def test_progress_line_has_the_cpu_use_and_a_straggler_gets_one_warning(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    results = tmp_path / "async"
    results.write_text(json.dumps({"started": 1, "finished": 0}))
    params = {
        "run_dir": str(run),
        "results_file": str(results),
        "nodes": NODES,
        "ranks_per_node": 4,
        "total_steps": 200,
        "excerpt_lines": 5,
    }
    (run / "metrics.partial.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _stats_rows(None)))
    state = watch.job_state(params)
    assert state["msg"].endswith(" · cpu 96 % (lowest node1 96 %) · slowest node1 compute 2.00 s vs median 2.00 s")
    assert state["straggler_warnings"] == {}

    (run / "metrics.partial.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _stats_rows(3)))
    state = watch.job_state(params)
    assert " · cpu 86 % (lowest node3 56 %) · slowest node3 compute 3.00 s vs median 2.00 s" in state["msg"]
    warning = state["straggler_warnings"]["node3"]
    assert warning.startswith("node3 (ranks 8-11) is a straggler") and "1.50× the median" in warning
    assert "56% under 80% for 4 intervals" in warning and warning.endswith("The job keeps running.")
    causes = [
        "(1) threads per rank vs. physical cores",
        "(2) another process",
        "(3) memory pressure or swap",
        "(4) a slower CPU",
    ]
    where = [warning.index(c) for c in causes]
    assert where == sorted(where), "the likely causes, in order"
    assert list(state["straggler_warnings"]) == ["node3"]
    assert state["layout_warning"] is None


def test_every_node_low_on_cpu_is_one_layout_warning_not_a_straggler_each(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    results = tmp_path / "async"
    results.write_text(json.dumps({"started": 1, "finished": 0}))
    params = {"run_dir": str(run), "results_file": str(results), "nodes": NODES, "ranks_per_node": 4}
    (run / "metrics.partial.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _stats_rows(None, all_low=True)))
    state = watch.job_state({**params, "total_steps": 200, "excerpt_lines": 5})
    assert state["straggler_warnings"] == {}
    warning = state["layout_warning"]
    assert warning.startswith("all 4 nodes equally low on CPU (11%, under 80% for 4 intervals), so no node is a ")
    assert "4 nodes × 4 ranks × 1 thread = 16 threads on 2 cores" in warning


def test_a_job_past_its_time_limit_says_so(tmp_path: Path) -> None:
    """run.sh's attempt has the job's time limit (I_MPI_JOB_TIMEOUT): an attempt that failed having run for all of
    it was ended by mpirun, as exit.json says (not Intel MPI's words in train.log)."""
    run = tmp_path / "run"
    run.mkdir()
    attempts.begin_attempt(run, now=1, time_limit_s=60)
    (run / "train.log").write_text(
        "\n".join(_startup()) + "\nI_MPI_JOB_TIMEOUT = 60 second(s): job ending due to application timeout\n"
    )
    assert attempts.write_exit(run, 255, now=61).timed_out
    results = tmp_path / "async"
    results.write_text(json.dumps({"rc": 255}))
    state = watch.job_state(
        {
            "run_dir": str(run),
            "results_file": str(results),
            "nodes": NODES,
            "ranks_per_node": 4,
            "total_steps": 200,
            "excerpt_lines": 5,
            "rank_status": _statuses(tmp_path / "nodes"),
        }
    )
    assert state["failure"]["summary"].startswith("the job ran past its time limit")
    # The same failure well within the limit is not a timeout.
    attempts.begin_attempt(run, now=100, time_limit_s=60)
    assert not attempts.write_exit(run, 255, now=130).timed_out


def test_a_killed_node_in_the_shape_mpirun_prints_it(tmp_path: Path) -> None:
    """As seen on the test cluster: one witness's error (its log line glued to rank 0's progress bar), then Hydra's
    own lines; mpirun ended the other ranks before they reported anything."""
    message = f"{LOST} ([pair.cc:537] Read error [10.0.0.13]:23753: Connection reset by peer.)"
    log = "\n".join(
        [
            *_startup(),
            f"[0] textual inversion:   2%|▏         | 9/400 [00:05<03:54,  1.67it/s, loss=1.1282, s_per_step=0.64][7] xeonsd "
            f"train: error: rank 7/16 on 10.0.0.12: {message}",
            "[mpiexec@vm] Error: Downstream from host 10.0.0.13 exited abnormally",
            "[mpiexec@vm] Trying to close other downstreams",
        ]
    )
    statuses = _statuses(tmp_path, {7: LastError("lost_peer", message, "10.0.0.13")})
    got = watch.diagnose(statuses, NODES, 4, attempt=1, log_text=log)
    assert got["nodes"] == ["node3"] and got["ranks"] == [8, 9, 10, 11], got
    assert any("Connection reset by peer" in line for line in got["excerpt"])
    assert "Downstream from host 10.0.0.13 exited abnormally" in got["excerpt"]
    assert "[rank 8] last line: 2026-11-30 10:00:00,000 [rank 8/16] INFO" in got["excerpt"][0]
    # mpirun ended every rank before one could write its error: Hydra's lost node, not all 16 silent ranks.
    got = watch.diagnose(_statuses(tmp_path / "none"), NODES, 4, attempt=1, log_text=log)
    assert got["nodes"] == ["node3"] and got["ranks"] == [8, 9, 10, 11], got
    got = watch.diagnose(_statuses(tmp_path / "none"), NODES, 4, attempt=1, log_text="\n".join(_startup()))
    assert got["ranks"] == list(range(16)), "no rank and no mpirun named a node: every silent rank"


# ---- what the real trainer writes, read back -----------------------------------------------------------------------


def test_what_the_package_writes_the_reader_accepts() -> None:
    status = RankStatus(
        rank=1,
        world=2,
        node="n",
        address="a",
        pid=1,
        state="failed",
        step=0,
        updated=0.0,
        error=LastError("lost_peer", "m", "10.0.0.1"),
    )
    assert watch.check_rank_status(dataclasses.asdict(status))["error"]["peer"] == "10.0.0.1"
    assert watch.check_rank_status(dataclasses.asdict(dataclasses.replace(status, error=None)))["error"] is None


def _job(run: Path, cli_env: dict, *args: str) -> dict:
    """run.sh's steps around the trainer, for real: begin the attempt, train (exported XEONSD_ATTEMPT), record the
    exit; then the finished job's state as the module computes it from the files the trainer wrote."""
    import subprocess

    from cli_runs import run_cli

    begin = subprocess.run(
        [sys.executable, "-m", "xeonsd.cli", "jobstatus", "begin", str(run)],
        env=cli_env,
        capture_output=True,
        text=True,
        check=True,
    )
    attempt = begin.stdout.strip()
    env = dict(cli_env, XEONSD_ATTEMPT=attempt, XEONSD_NODE_NAMES="127.0.0.1=node1")
    proc = run_cli(["train", *args], env)
    with open(run / "train.log", "a") as log:  # as mpirun -l >> train.log
        log.write("".join(f"[0] {line}\n" for line in proc.stderr.splitlines()))
    subprocess.run(
        [sys.executable, "-m", "xeonsd.cli", "jobstatus", "exit", str(run), "--rc", str(proc.returncode)],
        env=cli_env,
        check=True,
    )
    results = run / "async.json"
    results.write_text(json.dumps({"rc": proc.returncode}))
    return watch.job_state(
        {
            "run_dir": str(run),
            "results_file": str(results),
            "ranks_per_node": 1,
            "nodes": [{"name": "node1", "address": "127.0.0.1"}],
            "total_steps": 2,
            "excerpt_lines": 5,
        }
    )


def test_the_real_trainer_s_status_files_name_the_failing_rank(tiny_model, dataset, tmp_path, cli_env) -> None:
    """The trainer, on a bad input, and the module's diagnosis agree: its status file says input, the module names
    the rank and its error; a finished run leaves state done at the last step, and its start-up line is what the
    progress line counts."""
    from cli_runs import train_args

    run = tmp_path / "run"
    run.mkdir()
    state = _job(run, cli_env, *train_args(tiny_model, dataset, run, "--resolution=100", steps=2))
    assert state["exit_code"] == 2 and state["exit"]["attempt"] == 1
    status = json.loads((run / "status" / "rank-0.json").read_text())
    assert status["state"] == "failed" and status["attempt"] == 1 and status["node"] == "node1"
    assert status["error"]["kind"] == "input" and "multiple of 8" in status["error"]["message"]
    failure = state["failure"]
    assert failure["nodes"] == ["node1"] and failure["ranks"] == [0]
    assert failure["summary"] == "node1 (rank 0): failed with an error"
    assert "--resolution must be a positive multiple of 8" in failure["excerpt"][0]

    # The second attempt in the same run directory finishes: the first attempt's failure no longer counts.
    state = _job(run, cli_env, *train_args(tiny_model, dataset, run, steps=2))
    assert state["exit_code"] == 0 and state["exit"]["attempt"] == 2 and "failure" not in state
    status = json.loads((run / "status" / "rank-0.json").read_text())
    assert (status["state"], status["step"], status["attempt"], status["error"]) == ("done", 2, 2, None)
    assert len({m["rank"] for m in watch.STARTUP.finditer(watch.attempt_log(run))}) == 1
    assert not [p.name for p in (run / "status").iterdir() if not re.fullmatch(r"rank-\d+\.json", p.name)]


def test_a_long_poll_answers_when_the_job_ends_not_at_the_end_of_its_wait(tmp_path: Path) -> None:
    """wait_s (the role's long poll): the answer comes once Ansible's async results say the job ended; a job still
    running gets its progress after wait_s."""
    run = tmp_path / "run"
    run.mkdir()
    results = tmp_path / "async"
    results.write_text(json.dumps({"started": 1, "finished": 0}))
    params = {
        "run_dir": str(run),
        "results_file": str(results),
        "nodes": [],
        "ranks_per_node": 1,
        "total_steps": 10,
        "excerpt_lines": 5,
        "rank_status": None,
    }
    began = time.monotonic()
    running = watch.job_state({**params, "wait_s": 0.6})
    assert not running["finished"] and time.monotonic() - began >= 0.6
    ender = threading.Timer(0.3, lambda: results.write_text(json.dumps({"rc": 0, "changed": True})))
    ender.start()
    began = time.monotonic()
    ended = watch.job_state({**params, "wait_s": 60})
    ender.join()
    assert ended["finished"] and ended["exit_code"] == 0 and time.monotonic() - began < 30, ended
