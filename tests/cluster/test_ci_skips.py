"""The cluster tests' CI rule (ci_skips.py), on a small suite in a pytest of its own: with CI=true a skipped test
fails and says why (a skip in a session fixture, as the cluster's when not root, and one in the test), unless no
setup of the machine could run the case (ci_skips.not_applicable); without CI the same tests skip, and -rs lists
the reasons."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ci_skips import in_ci

HERE = Path(__file__).resolve().parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
from ci_skips import pytest_runtest_makereport
"""

SUITE = """
import pytest

@pytest.fixture(scope="session")
def cluster():
    pytest.skip("the test cluster needs root")

def test_on_the_cluster(cluster):
    pass

def test_that_skips_itself():
    pytest.skip("no cgroup v1 cpu controller")

def test_that_passes():
    pass

def test_of_a_missing_cpu_feature():
    from ci_skips import not_applicable
    not_applicable("this machine has AMX")
"""


def run_suite(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_suite.py").write_text(SUITE)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    if ci is not None:
        env["CI"] = ci
    argv = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist", str(tmp_path)]
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_in_ci_a_skipped_cluster_test_fails_naming_why(tmp_path: Path) -> None:
    proc = run_suite(tmp_path, "true")
    assert proc.returncode == 1, proc.stdout
    # the fixture's skip: an error in the setup; the case no machine setup could run stays a skip
    assert "1 failed, 1 passed, 1 skipped, 1 error" in proc.stdout, proc.stdout
    assert "not applicable on this machine: this machine has AMX" in proc.stdout
    for reason in ("the test cluster needs root", "no cgroup v1 cpu controller"):
        assert f"skipped in CI (CI=true), where a test of the test cluster must run: {reason}." in proc.stdout


def test_off_ci_they_skip_and_the_reasons_are_listed(tmp_path: Path) -> None:
    proc = run_suite(tmp_path, None)
    assert proc.returncode == 0, proc.stdout
    assert "1 passed, 3 skipped" in proc.stdout, proc.stdout
    assert "the test cluster needs root" in proc.stdout and "no cgroup v1 cpu controller" in proc.stdout


@pytest.mark.parametrize(
    ("value", "expected"), [("true", True), ("True", True), ("1", True), ("false", False), ("0", False), ("", False)]
)
def test_ci_is_ci_true(value: str, expected: bool) -> None:
    assert in_ci({"CI": value}) is expected
    assert in_ci({}) is False
