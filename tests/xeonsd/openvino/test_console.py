"""The quiet console of ``xeonsd generate`` / ``export``: our own lines on the console, the libraries' chatter in
the log beside the output, all of it on the console with ``-v``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from cli_runs import run_cli

from xeonsd.console import log_path_beside, quiet_console

# Lines the libraries print on every optimum-engine generate (optimum-intel's notices): what the console must not show.
CHATTER = ("disabled the safety checker", "Could not infer whether the model was already converted", "refs/main")
ALSO_NOT = ("Multiple distributions found", "deprecated", "it/s]")


def _generate(ov_dir: Path, out: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    args = ["generate", str(ov_dir), "--engine", "optimum", "--steps", "1", "--out", str(out), *extra]
    return run_cli(args, env, timeout=300)


def test_generate_shows_our_lines_and_keeps_the_chatter_in_the_log(ov_baked: Path, tmp_path: Path, cli_env) -> None:
    out = tmp_path / "images"
    quiet = _generate(ov_baked, out, cli_env)
    assert quiet.returncode == 0, quiet.stderr
    console = quiet.stdout + quiet.stderr
    assert [line for line in console.splitlines() if any(c in line for c in CHATTER + ALSO_NOT)] == []
    assert json.loads(quiet.stdout)["out"] == str(out)  # stdout is the result line alone
    assert "call 1/1: 5 image(s)" in quiet.stderr  # our own log line
    log = log_path_beside(out).read_text()
    assert all(c in log for c in CHATTER), log

    loud = _generate(ov_baked, out, cli_env, "--overwrite", "-v", "--log", str(tmp_path / "v.log"))
    assert loud.returncode == 0, loud.stderr
    assert all(c in loud.stderr for c in CHATTER), loud.stderr
    assert all(c in (tmp_path / "v.log").read_text() for c in CHATTER)
    assert json.loads(loud.stdout)["out"] == str(out)


def test_c_level_output_goes_to_the_log_and_a_failure_shows_its_tail(tmp_path: Path, capfd) -> None:
    log = tmp_path / "x.log"
    with pytest.raises(RuntimeError), quiet_console(log) as console:
        os.write(2, b"chatter written by C++ straight to fd 2\n")
        print("library print", flush=True)
        print("our result", file=console)
        raise RuntimeError("inference failed")
    cap = capfd.readouterr()
    assert cap.out == "our result\n"
    assert f"the libraries' output is in {log}" in cap.err
    assert "chatter written by C++" in cap.err  # the tail, after the failure
    assert "chatter written by C++" in log.read_text() and "library print" in log.read_text()


def test_an_error_of_our_own_shows_no_tail_and_keeps_the_earlier_log(tmp_path: Path, capfd) -> None:
    log = tmp_path / "x.log"
    log.write_text("the earlier run's log\n")
    with pytest.raises(ValueError), quiet_console(log, expected=(ValueError,)):
        os.write(1, b"some chatter\n")
        raise ValueError("the output exists")
    cap = capfd.readouterr()
    assert "some chatter" not in cap.out + cap.err
    assert log.read_text() == "the earlier run's log\n" and sorted(p.name for p in tmp_path.iterdir()) == ["x.log"]
