"""A rank that dies or stalls mid-run ends the whole job quickly instead of hanging it (real mpirun, 2 ranks), and
the status files the ranks leave make the finetune role's diagnosis name the lost rank."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_runs import train_args

from xeonsd.jobs import watch

STEP_TIMEOUT_S = 5


def _rank_pids(marker: str) -> dict[int, int]:
    """{rank: pid} of the training processes whose command line contains ``marker``."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            if not any(marker.encode() in part for part in cmdline) or b"xeonsd.cli" not in cmdline:
                continue
            env = dict(kv.split(b"=", 1) for kv in (proc / "environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"PMI_RANK" in env:
            found[int(env[b"PMI_RANK"])] = int(proc.name)
    return found


def _wait_for_step(metrics: Path, step: int, job: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert job.poll() is None, f"the job ended early: {job.communicate()[0][-3000:]}"
        if metrics.exists():
            rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
            if rows and rows[-1]["step"] >= step:
                return
        time.sleep(0.2)
    pytest.fail(f"no step {step} within {timeout} s")


@pytest.mark.parametrize(
    "sig, what",
    [(signal.SIGKILL, "killed (a crashed rank or a dead node)"), (signal.SIGSTOP, "stopped (a hung rank)")],
)
def test_a_lost_rank_ends_the_job(sig, what, tiny_model, dataset, tmp_path, cli_env):
    mpirun = shutil.which("mpirun", path=cli_env["PATH"])
    assert mpirun, "mpirun (impi-rt) is not installed in the environment"
    out = tmp_path / f"run-{sig.name}"
    env = dict(cli_env, XEONSD_STEP_TIMEOUT=str(STEP_TIMEOUT_S))
    cmd = [
        mpirun,
        "-n",
        "2",
        sys.executable,
        "-m",
        "xeonsd.cli",
        "train",
        *train_args(tiny_model, dataset, out, steps=100000),
        "--log_every=1",
    ]
    job = subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    victim = None
    try:
        _wait_for_step(out / "metrics.partial.jsonl", 3, job, timeout=240)
        pids = _rank_pids(str(out))
        assert set(pids) == {0, 1}, pids
        victim = pids[1]
        os.kill(victim, sig)
        t_lost = time.monotonic()
        output, _ = job.communicate(timeout=120)
        ended_after = time.monotonic() - t_lost
    finally:
        if job.poll() is None:
            job.kill()
        if victim is not None:
            for s in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(victim, s)
                except ProcessLookupError:
                    break
    print(f"\nrank 1 {what}: the job ended {ended_after:.1f} s later (step timeout {STEP_TIMEOUT_S} s)")
    assert job.returncode != 0
    # A kill is seen at once (closed connections); a stall is cut off by the step timeout, plus shutdown.
    assert ended_after < STEP_TIMEOUT_S + 30, output[-3000:]
    assert "xeonsd train: error: rank 0/2 on " in output, output[-3000:]
    # Which collective rank 0 was in when rank 1 went (the gradient all-reduce, or with --log_every=1 the
    # statistics' all-gather) depends on timing; every one of them ends the job with the same cause.
    assert "failed: a peer rank died, its node went away or it stalled" in output, output[-3000:]
    assert not (out / "metrics.jsonl").exists(), "a failed run must not leave a final-looking metrics.jsonl"
    # What the ranks wrote: the survivor failed on its lost peer (closed connection) or the collective timeout
    # (stall); the lost rank's file still says running. The role's diagnosis, fed these files, names rank 1.
    statuses = watch.read_status_dir(str(out / "status"))
    by_rank = {s["rank"]: s for s in statuses}
    assert set(by_rank) == {0, 1}, statuses
    assert by_rank[0]["state"] == "failed" and by_rank[0]["error"]["kind"] in ("lost_peer", "timeout"), by_rank[0]
    assert by_rank[1]["state"] == "running" and by_rank[1]["step"] >= 3 and by_rank[1]["error"] is None, by_rank[1]
    here = by_rank[0]["address"]
    failure = watch.diagnose(statuses, [{"name": "here", "address": here}], 2, log_text=output)
    assert failure["ranks"] == [1] and failure["nodes"] == ["here"], failure
    assert failure["summary"].startswith("here (rank 1): stopped without an error of their own"), failure
