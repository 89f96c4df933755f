"""The finetune role's job module: progress from the trainer's metrics, and which node a failed job blames.

The logs below have the shape `mpirun -l` gives the trainer's output (every line prefixed with its rank)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# The module's logic, not the module: importing ansible.module_utils.basic patches sys.intern for the whole process,
# which breaks torch._dynamo (and so diffusers) in every test that runs after it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "roles" / "finetune" / "module_utils"))

import xeonsd_joblog as xeonsd_job  # noqa: E402

NODES = [{"name": f"node{i}", "address": f"10.0.0.{10 + i}"} for i in range(1, 5)]


def _startup(world: int = 16, ppn: int = 4) -> list[str]:
    return [
        f"[{r}] 2026-11-30 10:00:00,000 [rank {r}/{world}] INFO xeonsd.train: node=10.0.0.{11 + r // ppn} pid={100 + r} "
        "launcher=intel-mpi backend=gloo threads=1"
        for r in range(world)
    ]


def test_a_node_whose_ranks_fail_with_their_own_error_is_named_with_its_error_lines() -> None:
    lines = [
        "#### xeonsd attempt started 2026-11-30T10:00:00Z on node1",
        *[f"[{r}] xeonsd train: error: rank {r}/16 on 10.0.0.13: no images found in /home/devcloud/dicoo" for r in (8, 9, 10, 11)],
        "[0] xeonsd train: error: rank 0/16 on 10.0.0.11: the barrier failed: a peer rank died, its node went away or "
        "it stalled past the collective timeout (Connection closed by peer [10.0.0.13]:4000)",
    ]  # fmt: skip
    got = xeonsd_job.diagnose("\n".join(lines), NODES, 4)
    assert got["nodes"] == ["node3"] and got["ranks"] == [8, 9, 10, 11]
    assert got["summary"].startswith("node3 (ranks 8-11): failed with an error")
    assert "no images found" in got["excerpt"][0]


def test_a_killed_node_is_the_silent_one_its_peers_name() -> None:
    lines = [
        *_startup(),
        "[4] xeonsd train: error: rank 4/16 on 10.0.0.12: the all-reduce failed: a peer rank died, its node went "
        "away or it stalled past the collective timeout (Read error [10.0.0.13]:51234: Connection reset by peer)",
        "[12] xeonsd train: error: rank 12/16 on 10.0.0.14: the all-reduce failed: a peer rank died, its node went "
        "away or it stalled past the collective timeout (Connection closed by peer [10.0.0.13]:51777)",
    ]  # fmt: skip
    got = xeonsd_job.diagnose("\n".join(lines), NODES, 4)
    assert got["nodes"] == ["node3"] and got["ranks"] == [8, 9, 10, 11]
    assert "2 other rank(s) reported losing them" in got["summary"]
    assert any("Connection reset by peer" in line for line in got["excerpt"])


def test_a_stalled_node_is_the_one_that_did_not_time_out() -> None:
    lost = ("the all-reduce failed: a peer rank died, its node went away or it stalled past the collective timeout "
            "(Timed out waiting 45000ms for recv operation to complete)")  # fmt: skip
    lines = [*_startup(), *[f"[{r}] xeonsd train: error: rank {r}/16 on x: {lost}" for r in range(16) if r // 4 != 1]]
    got = xeonsd_job.diagnose("\n".join(lines), NODES, 4)
    assert got["nodes"] == ["node2"] and got["ranks"] == [4, 5, 6, 7]


def test_only_the_newest_attempt_counts() -> None:
    old = "#### xeonsd attempt 1\n[8] xeonsd train: error: rank 8/16 on 10.0.0.13: no images found"
    new = "#### xeonsd attempt 2\n[2] xeonsd train: error: rank 2/16 on 10.0.0.11: checkpoint is unreadable"
    got = xeonsd_job.diagnose(old + "\n" + new, NODES, 4)
    assert got["nodes"] == ["node1"] and got["ranks"] == [2]


def test_progress_line_and_job_state(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "loss": 0.5 / s, "s_per_step": 2.0, "ranks": 16, "backend": "gloo"} for s in range(1, 51)]
    (run / "metrics.partial.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 51, "lo')
    results = tmp_path / "async"
    results.write_text(json.dumps({"started": 1, "finished": 0}))
    params = {"run_dir": str(run), "results_file": str(results), "nodes": NODES, "ranks_per_node": 4,
              "total_steps": 200, "excerpt_lines": 5}  # fmt: skip
    state = xeonsd_job.job_state(params)
    assert not state["finished"]
    assert state["msg"] == "step 50/200 (25%) · loss 0.0100 · 2.00 s/step · ~5m 00s left · 16 ranks (gloo)"
    # The last step is logged: the job is still saving the embedding and the pipeline, not stuck at ~0s left.
    assert xeonsd_job.job_state({**params, "total_steps": 50})["msg"] == (
        "step 50/50 (100%) · loss 0.0100 · 2.00 s/step · saving the outputs · 16 ranks (gloo)"
    )

    # The job ended: run.sh's exit.json gives the rc; a failure is diagnosed from train.log.
    results.write_text(json.dumps({"rc": 2, "cmd": ["flock"]}))
    (run / "exit.json").write_text(json.dumps({"rc": 2, "started": 1, "ended": 61}))
    (run / "train.log").write_text("[5] xeonsd train: error: rank 5/16 on 10.0.0.12: the model is missing\n")
    state = xeonsd_job.job_state(params)
    assert state["finished"] and state["exit_code"] == 2
    assert state["failure"]["nodes"] == ["node2"]

    # The lock was taken between the check and the launch: flock's own exit code.
    (run / "exit.json").unlink()
    results.write_text(json.dumps({"rc": 75}))
    state = xeonsd_job.job_state(params)
    assert state["exit_code"] == 75 and "holds the lock" in state["failure"]["summary"]


def _stats_rows(slow_node: int | None) -> list[dict]:
    """Metrics rows as the trainer writes them (xeonsd.rankstats), 16 ranks on 4 nodes, stats every 5 steps."""
    from xeonsd.rankstats import Interval, StragglerWatch, summarize

    watch = StragglerWatch()
    rows = []
    for step in range(1, 21):
        row = {"step": step, "loss": 0.1, "s_per_step": 3.2, "ranks": 16, "backend": "gloo"}
        if step % 5 == 0:
            ivs = []
            for r in range(16):
                slow = r // 4 + 1 == slow_node
                compute, allreduce, util = (3.0, 0.1, 0.56) if slow else (2.0, 1.1, 0.96)
                wall = 5 * (compute + allreduce + 0.1)
                ivs.append(Interval(5, wall, util * wall * 4, 4, 0.5, 5 * allreduce))
            summary = summarize(ivs, [f"node{r // 4 + 1}" for r in range(16)])
            row |= {"rank_stats": summary, "stragglers": watch.judge(summary)}
        rows.append(row)
    return rows


def test_progress_line_has_the_cpu_use_and_a_straggler_gets_one_warning(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    results = tmp_path / "async"
    results.write_text(json.dumps({"started": 1, "finished": 0}))
    params = {"run_dir": str(run), "results_file": str(results), "nodes": NODES, "ranks_per_node": 4,
              "total_steps": 200, "excerpt_lines": 5}  # fmt: skip
    (run / "metrics.partial.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _stats_rows(None)))
    state = xeonsd_job.job_state(params)
    assert state["msg"].endswith(" · cpu 96 % (lowest node1 96 %) · slowest node1 compute 2.00 s vs median 2.00 s")
    assert state["straggler_warnings"] == {}

    (run / "metrics.partial.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _stats_rows(3)))
    state = xeonsd_job.job_state(params)
    assert " · cpu 86 % (lowest node3 56 %) · slowest node3 compute 3.00 s vs median 2.00 s" in state["msg"]
    warning = state["straggler_warnings"]["node3"]
    assert warning.startswith("node3 (ranks 8-11) is a straggler") and "1.50× the median" in warning
    assert "56% under 80% for 4 intervals" in warning and warning.endswith("The job keeps running.")
    causes = ["(1) threads per rank vs. physical cores", "(2) another process", "(3) memory pressure or swap",
              "(4) a slower CPU"]  # fmt: skip
    where = [warning.index(c) for c in causes]
    assert where == sorted(where), "the likely causes, in order"
    assert list(state["straggler_warnings"]) == ["node3"]


def test_a_job_past_its_time_limit_says_so(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").write_text("\n".join(_startup()) + "\nI_MPI_JOB_TIMEOUT = 60 second(s): job ending due to "
                                   "application timeout\n")  # fmt: skip
    (run / "exit.json").write_text(json.dumps({"rc": 255, "started": 1, "ended": 61}))
    results = tmp_path / "async"
    results.write_text(json.dumps({"rc": 255}))
    state = xeonsd_job.job_state({"run_dir": str(run), "results_file": str(results), "nodes": NODES,
                                  "ranks_per_node": 4, "total_steps": 200, "excerpt_lines": 5})  # fmt: skip
    assert state["failure"]["summary"].startswith("the job ran past its time limit")


def test_a_killed_node_in_the_shape_mpirun_prints_it() -> None:
    """As seen on the test cluster: a witness's error glued to rank 0's progress bar, then Hydra's own lines."""
    log = "\n".join([
        *_startup(),
        "[0] textual inversion:   2%|▏         | 9/400 [00:05<03:54,  1.67it/s, loss=1.1282, s_per_step=0.64][7] xeonsd "
        "train: error: rank 7/16 on 10.0.0.12: the all-reduce failed: a peer rank died, its node went away or it "
        "stalled past the collective timeout ([pair.cc:537] Read error [10.0.0.13]:23753: Connection reset by peer.)",
        "[mpiexec@vm] Error: Downstream from host 10.0.0.13 exited abnormally",
        "[mpiexec@vm] Trying to close other downstreams",
    ])  # fmt: skip
    got = xeonsd_job.diagnose(log, NODES, 4)
    assert got["nodes"] == ["node3"] and got["ranks"] == [8, 9, 10, 11], got
    assert any("Connection reset by peer" in line for line in got["excerpt"])
    assert "Downstream from host 10.0.0.13 exited abnormally" in got["excerpt"]


def test_the_job_logic_imports_without_ansible() -> None:
    """The tests run it in the pytest process; it must not load Ansible there (see the import above)."""
    import subprocess

    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import xeonsd_joblog; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'ansible'))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(Path(xeonsd_job.__file__).parent)],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == "[]"
