"""The tests' fork server (cli_forkserver.py) gives what a plain ``python -m xeonsd.cli`` subprocess gives: exit
status, stdout and stderr, a process of its own that a timeout kills; an environment it cannot give falls back."""

from __future__ import annotations

import subprocess
import sys
import time

import cli_forkserver
import pytest
from cli_runs import method_args, train_args


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
    # The killed run's process group is gone: nothing of it is left running.
    leftover = subprocess.run(["pgrep", "-f", f"--output_dir={out}"], capture_output=True, text=True).stdout
    assert leftover.strip() == "", leftover


def test_an_environment_read_at_import_falls_back_to_a_subprocess(tmp_path, cli_env):
    cli_forkserver.run(["jobstatus", "codes"], cli_env, timeout=120)  # the server, with this environment
    assert cli_forkserver._server.differences(cli_env | {"XEONSD_ANY": "1", "PYTEST_CURRENT_TEST": "x"}) == []
    hub = cli_env | {"HF_HOME": str(tmp_path / "hub")}
    assert cli_forkserver._server.differences(hub) == ["HF_HOME"]
    # The run itself still happens, as a plain subprocess (the server never sees it).
    done = cli_forkserver.run(["jobstatus", "codes"], hub, timeout=120)
    assert done.returncode == 0 and done.stdout == cli_forkserver.run(["jobstatus", "codes"], cli_env, 120).stdout
