"""The mpi role's wrapper (roles/mpi/templates/run.j2, /etc/xeonsd/run on the nodes): `run [--no-preload] CMD ARG...`
sources env.sh and execs CMD; its exit codes become doctor's env rows (plugins/filter/xeonsd_doctor.py). The
template is rendered and run for real with bash."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from repo_code import ansible_code, write_wrapper

xeonsd_doctor = ansible_code("xeonsd_doctor")


@pytest.fixture
def etc(tmp_path: Path) -> Path:
    """A node's xeonsd_etc_dir with the rendered wrapper (and no env.sh yet)."""
    etc = tmp_path / "etc xeonsd"  # a space in the path: the wrapper quotes it
    etc.mkdir()
    write_wrapper(etc)
    return etc


def run(etc: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["timeout", "60", str(etc / "run"), *argv], capture_output=True, text=True)


def env_row(result: subprocess.CompletedProcess) -> dict:
    """The row doctor makes of this result when it is the node's `xeonsd doctor` run (node.yml's registered shape)."""
    registered = {"rc": result.returncode, "stdout_lines": result.stdout.splitlines(), "stderr": result.stderr}
    (row,) = xeonsd_doctor.node_rows("node1", registered, 1200)
    return row


def test_the_command_runs_with_env_sh_sourced_and_its_arguments_intact(etc: Path) -> None:
    (etc / "env.sh").write_text("export XEONSD_PROBE='from env.sh'\nexport LD_PRELOAD=\n")
    result = run(etc, "sh", "-c", 'printf "%s|" "$XEONSD_PROBE" "${LD_PRELOAD-unset}" "$@"', "sh", "a b", "")
    assert (result.returncode, result.stdout) == (0, "from env.sh||a b||"), result.stderr
    assert run(etc, "sh", "-c", "exit 7").returncode == 7


def test_no_preload_runs_without_env_sh_ld_preload(etc: Path) -> None:
    (etc / "env.sh").write_text("export XEONSD_PROBE=yes\nexport LD_PRELOAD=\n")
    result = run(etc, "--no-preload", "sh", "-c", 'printf "%s %s" "$XEONSD_PROBE" "${LD_PRELOAD-unset}"')
    assert (result.returncode, result.stdout) == (0, "yes unset"), result.stderr


def test_a_missing_env_sh_is_rc_90_and_doctor_s_env_row(etc: Path) -> None:
    result = run(etc, "true")
    assert result.returncode == xeonsd_doctor.RC_NO_ENV_FILE == 90
    assert f"{etc}/env.sh is missing or unreadable for " in result.stderr and "not provisioned" in result.stderr
    assert env_row(result) == {"node": "node1", "check": "env", "status": "FAIL", "detail": result.stderr.strip()}


def test_a_command_not_on_env_sh_path_is_rc_91_and_doctor_s_env_row(etc: Path) -> None:
    (etc / "env.sh").write_text("export PATH=/nonexistent-env/bin:$PATH\n")
    result = run(etc, "xeonsd-not-installed", "doctor")
    assert result.returncode == xeonsd_doctor.RC_NO_COMMAND == 91
    assert "no xeonsd-not-installed on PATH after sourcing" in result.stderr and "/nonexistent-env/bin" in result.stderr
    assert env_row(result)["check"] == "env" and env_row(result)["status"] == "FAIL"


def test_no_command_is_a_usage_error(etc: Path) -> None:
    (etc / "env.sh").write_text("")
    result = run(etc)
    assert result.returncode == 2 and "usage: " in result.stderr


def test_a_node_without_the_wrapper_is_doctor_s_env_row(tmp_path: Path) -> None:
    # node.yml runs `timeout ... /etc/xeonsd/run xeonsd doctor ...`: an unprovisioned node has no wrapper.
    result = run(tmp_path, "xeonsd", "doctor")
    assert result.returncode in xeonsd_doctor.RC_NO_WRAPPER, result
    row = env_row(result)
    assert row["check"] == "env" and row["status"] == "FAIL" and f"{tmp_path}/run" in row["detail"], row
