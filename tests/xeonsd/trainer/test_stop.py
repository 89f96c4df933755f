"""A training job that is told to stop stops cleanly (xeonsd.trainer.stopping), under real mpirun with 2 ranks: a
signal that reaches one rank only stops both after the same step; SIGTERM to the launcher leaves a checkpoint at
that step, both status files ``interrupted``, exit 143, and the resumed run ends with the weights of the run that
was never stopped; a SIGINT before the first step exits 130 at once, leaving no output that looks done.

The launcher is ``mpiexec.hydra``: Intel MPI's ``mpirun`` is a sh script around it that passes no signal on (the
finetune role's run.sh starts mpiexec.hydra for that reason)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_runs import TOKEN, assert_learned, mpi_env, train, train_args
from safetensors.torch import load_file

from xeonsd.jobs import watch
from xeonsd.trainer.checkpoint import list_checkpoints

# Every rank runs this: rank 1 alone sends itself SIGTERM before the all-reduce of step 3 (rank 0 gets no signal),
# then two more signals while "stopping" (ignored); each rank prints where it stopped.
AGREE = """
import json, os, signal, sys, time
from xeonsd.cluster.launch import detect_ranks
from xeonsd.cluster.distributed import barrier, destroy_process_group, init_process_group
from xeonsd.trainer.stopping import StopSignals
info = detect_ranks()
init_process_group(info, backend="gloo")
signals = StopSignals().install()
signals.defer()
for step in range(1, 50):
    time.sleep(0.02 * info.rank)
    if info.rank == 1 and step == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    own = signals.signum
    agreed = signals.agree(info.world_size)
    if agreed:
        if info.rank == 1:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
        print(json.dumps({"rank": info.rank, "step": step, "agreed": agreed, "own": own, "after": signals.signum}))
        break
# As the trainer ends (loop.run): both ranks done with the group before either exits; a rank whose peer's gloo
# connection closes under its own background thread aborts ("terminate called without an active exception").
barrier(info.world_size)
destroy_process_group()
"""


def vectors(out: Path) -> torch.Tensor:
    return load_file(str(out / "learned_embeds.safetensors"))[TOKEN]


def _hydra(env: dict[str, str]) -> str:
    launcher = shutil.which("mpiexec.hydra", path=env["PATH"])
    assert launcher, "mpiexec.hydra (impi-rt) is not installed in the environment"
    return launcher


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(tmp_path: Path, cli_env) -> None:
    script = tmp_path / "agree.py"
    script.write_text(AGREE)
    cmd = [_hydra(cli_env), "-n", "2", sys.executable, str(script)]
    proc = subprocess.run(cmd, env=mpi_env(cli_env), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # mpiexec.hydra merges the ranks' stdout as it comes: one rank's line can arrive before the other's newline
    # (seen: '{"rank": 1, ...}{"rank": 0, ...}'), so the rows are the JSON objects, not the lines.
    rows = sorted((json.loads(obj) for obj in re.findall(r"\{[^{}]*\}", proc.stdout)), key=lambda r: r["rank"])
    assert rows == [
        {"rank": 0, "step": 3, "agreed": 15, "own": 0, "after": 15},  # told through the all-reduce
        {"rank": 1, "step": 3, "agreed": 15, "own": 15, "after": 15},  # the later SIGINT and SIGTERM changed nothing
    ], proc.stderr[-2000:]
    assert "already stopping on SIGTERM; ignored" in proc.stderr


def _wait_for_step(metrics: Path, step: int, job: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert job.poll() is None, f"the job ended early: {job.communicate()[0][-3000:]}"
        rows = metrics.read_text().splitlines() if metrics.exists() else []
        if rows and json.loads(rows[-1])["step"] >= step:
            return
        time.sleep(0.05)
    pytest.fail(f"no step {step} within {timeout} s")


def _left_behind(out: Path) -> list[str]:
    """Temporary files or directories of an atomic write (".<name>.tmp-…") anywhere under ``out``."""
    return sorted(str(p.relative_to(out)) for p in out.rglob(".*tmp*"))


def test_sigterm_stops_both_ranks_at_one_step_with_a_checkpoint_and_resume_equals_the_uninterrupted_run(
    tiny_model, dataset, tmp_path, cli_env
):
    out = tmp_path / "stopped"
    cmd = [_hydra(cli_env), "-n", "2", sys.executable, "-m", "xeonsd.cli", "train"]
    shm = f"--shared_weights_dir={tmp_path / 'shm'}"  # 2 ranks on one node: the frozen weights shared (auto)
    args = train_args(tiny_model, dataset, out, "--log_every=1", shm, steps=100000)  # --checkpointing_steps=0
    job = subprocess.Popen(
        [*cmd, *args], env=mpi_env(cli_env), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        _wait_for_step(out / "metrics.partial.jsonl", 2, job, timeout=240)
        job.send_signal(signal.SIGTERM)
        job.send_signal(signal.SIGTERM)  # a second one while the job stops: ignored, nothing broken
        output, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 143, output[-3000:]
    statuses = watch.read_status_dir(str(out / "status"))
    assert [(s["rank"], s["state"]) for s in statuses] == [(0, "interrupted"), (1, "interrupted")], statuses
    step = statuses[0]["step"]
    stop = {"signal": "SIGTERM", "reason": "signal", "step": step, "checkpoint": f"checkpoint-{step}"}
    assert step >= 2 and all(s["step"] == step and s["stop"] == stop for s in statuses), statuses
    # The checkpoint at that step (no periodic ones: --checkpointing_steps=0), no result, no final metrics.
    assert [s for s, _ in list_checkpoints(out)] == [step]
    assert not (out / "learned_embeds.safetensors").exists() and not (out / "metrics.jsonl").exists()
    assert json.loads((out / "metrics.partial.jsonl").read_text().splitlines()[-1])["step"] == step
    assert _left_behind(out) == []
    assert f"stopped by SIGTERM at step {step} (checkpoint-{step} written)" in output
    assert "frozen weights mapped from" in output
    assert not list((tmp_path / "shm").glob("*/*.weights")), "a stopped job removes its shared weights too"
    here = statuses[0]["address"]
    summary = watch.diagnose(statuses, [{"name": "here", "address": here}], 2)["summary"]
    assert summary == f"stopped by SIGTERM at step {step} (checkpoint-{step} written); resume with -e resume=latest"

    # Resumed to two steps past the stop, it ends where a run that was never stopped does.
    resumed = train(
        train_args(tiny_model, dataset, out, "--resume_from_checkpoint=latest", shm, steps=step + 2), cli_env, 2
    )
    assert f"resumed from {out / f'checkpoint-{step}'} at step {step}" in resumed.stderr
    assert "frozen weights mapped from" in resumed.stderr
    full = tmp_path / "full"
    train(train_args(tiny_model, dataset, full, steps=step + 2), cli_env, 2)
    assert_learned(vectors(full), tiny_model)
    torch.testing.assert_close(vectors(out), vectors(full), atol=1e-6, rtol=0)
    assert {s["state"] for s in watch.read_status_dir(str(out / "status"))} == {"done"}


def test_sigint_before_the_first_step_exits_130_and_leaves_nothing_that_looks_done(
    tiny_model, dataset, tmp_path, cli_env
):
    out = tmp_path / "early"
    cmd = [sys.executable, "-m", "xeonsd.cli", "train", *train_args(tiny_model, dataset, out, steps=100000)]
    job = subprocess.Popen(cmd, env=cli_env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    status = out / "status" / "rank-0.json"
    try:
        deadline = time.monotonic() + 120
        while not status.exists():  # written once the inputs passed their checks, before the models load
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0][-3000:]
            time.sleep(0.01)
        job.send_signal(signal.SIGINT)
        output, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 130, output[-3000:]
    written = json.loads(status.read_text())
    assert (written["state"], written["step"]) == ("interrupted", 0), written
    assert written["stop"] == {"signal": "SIGINT", "reason": "signal", "step": 0, "checkpoint": None}
    assert "stopped by SIGINT before the first training step" in output and "Traceback" not in output
    # the status files, the memory estimate the input checks wrote and the libraries' log: no result, checkpoint or
    # partial file
    names = set(p.name for p in out.iterdir())
    assert names <= {"status", "memory_estimate.json", "libraries.log"} and _left_behind(out) == []
