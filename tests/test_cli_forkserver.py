"""The tests' fork server (cli_forkserver.py) gives what a plain ``python -m xeonsd.cli`` subprocess gives: exit
status, stdout and stderr, a process of its own that a timeout kills; an environment it cannot give falls back."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import cli_forkserver
import pytest
from cli_runs import method_args, mpi_env, train_args


def test_a_forked_run_answers_as_a_subprocess_does(tiny_model, dataset, tmp_path, cli_env):
    # A refusal the trainer makes after torch loaded (the data has no captions), and one made from the flags alone.
    for args in (
        ["train", *method_args("lora", tiny_model, dataset, tmp_path / "a")],
        ["train", *method_args("textual_inversion", tiny_model, dataset, tmp_path / "b", "--rank=8")],
    ):
        forked = cli_forkserver.run(args, cli_env, timeout=120)
        plain = subprocess.run(
            [sys.executable, "-m", "xeonsd.cli", *args], env=cli_env, capture_output=True, text=True, timeout=120
        )
        assert (forked.returncode, forked.stdout, forked.stderr) == (plain.returncode, plain.stdout, plain.stderr)
        assert forked.returncode == 2 and "xeonsd train: error: " in forked.stderr
    assert cli_forkserver._server is not None and not cli_forkserver._server.differences(cli_env)


def test_a_timeout_kills_the_run_and_raises(tiny_model, dataset, tmp_path, cli_env):
    out = tmp_path / "long"
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        cli_forkserver.run(["train", *train_args(tiny_model, dataset, out, steps=100000)], cli_env, timeout=8)
    assert time.monotonic() - started < 40
    # The killed run is gone: the server has no run left (a run is a child of the server's child, the monitor).
    assert _wait_for(_forked_runs, 0) == []


def test_an_environment_read_at_import_falls_back_to_a_subprocess(tmp_path, cli_env):
    cli_forkserver.run(["jobstatus", "codes"], cli_env, timeout=120)  # the server, with this environment
    assert cli_forkserver._server.differences(cli_env | {"XEONSD_ANY": "1", "PYTEST_CURRENT_TEST": "x"}) == []
    hub = cli_env | {"HF_HOME": str(tmp_path / "hub")}
    assert cli_forkserver._server.differences(hub) == ["HF_HOME"]
    # The run itself still happens, as a plain subprocess (the server never sees it).
    done = cli_forkserver.run(["jobstatus", "codes"], hub, timeout=120)
    assert done.returncode == 0 and done.stdout == cli_forkserver.run(["jobstatus", "codes"], cli_env, 120).stdout


def test_a_killed_rank_shim_takes_its_forked_rank_and_the_job_down(tiny_model, dataset, tmp_path, cli_env):
    """Under mpirun each rank is a shim whose rank the server forked: a shim killed mid-run (a crashed rank, as
    mpirun sees it) ends its rank too; the other rank finds its peer gone and fails, mpirun ends the job, and no rank
    is left running."""
    out = tmp_path / "job"
    env = mpi_env(cli_env)
    cmd = [shutil.which("mpirun", path=env["PATH"]), "-n", "2", *cli_forkserver.rank_command(env), "train"]
    job = subprocess.Popen(
        [*cmd, *train_args(tiny_model, dataset, out, "--log_every=1", steps=100000)], env=env, **QUIET
    )
    try:
        shims = _wait_for(lambda: _pids(f"--output_dir={out}"), 2)
        _wait_for(_forked_runs, 2)  # the two ranks, forked by the server
        _wait_for(lambda: [1] if (out / "metrics.partial.jsonl").is_file() else [], 1, timeout=240)  # stepping
        os.kill(shims[1], signal.SIGKILL)
        job.wait(timeout=120)
        assert job.returncode != 0
        assert _wait_for(_forked_runs, 0) == []
    finally:
        job.kill()


QUIET = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}


def _pids(pattern: str) -> list[int]:
    """The shims among the processes pgrep finds (not mpirun's, whose command lines hold the shim's)."""
    found = map(int, subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True).stdout.split())
    return sorted(p for p in found if _argv(p)[1:2] and _argv(p)[1].endswith("cli_forkserver.py"))


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().split("\0")
    except OSError:
        return []


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _forked_runs() -> list[int]:
    """The runs the worker's server forked and that are still running: the children of its children."""
    return [run for monitor in _children(cli_forkserver._server.proc.pid) for run in _children(monitor)]


def _wait_for(probe, count: int, timeout: float = 60) -> list[int]:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(found := probe()) == count:
            return found
        time.sleep(0.2)
    raise AssertionError(f"expected {count} processes, found {probe()}")
