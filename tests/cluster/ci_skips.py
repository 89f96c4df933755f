"""In CI (``CI=true`` in the environment) a test of the test cluster that skips is a failure, with the skip's reason.

Off CI a cluster test skips where the machine cannot run it (not root, no iproute2, no cgroup v1 cpu controller):
a developer's `make test` stays useful there. In CI a skip would leave the playbooks untested behind a green run,
so the skip's report becomes a failure naming why. tests/cluster/conftest.py imports the hook, so it applies to the
tests of that directory only.

The one exception is a case that no setup of the machine could run, its skip made with :func:`not_applicable`
(a refusal for a missing CPU feature on a machine that has it): that stays a skip in CI too.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Mapping

import pytest


def in_ci(env: Mapping[str, str]) -> bool:
    """Whether this run is CI's: ``CI=true`` (set by GitHub Actions, GitLab CI and most others; any case, or 1)."""
    return env.get("CI", "").strip().lower() in ("true", "1")


NOT_APPLICABLE = "not applicable on this machine: "


def not_applicable(reason: str) -> None:
    """Skip a case this machine can never run, whatever its setup (CI too): the reason says why."""
    pytest.skip(NOT_APPLICABLE + reason)


def skip_reason(report: pytest.TestReport) -> str:
    """A skipped report's reason, without pytest's "Skipped: " prefix."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.skipped and not hasattr(report, "wasxfail") and in_ci(os.environ):
        if skip_reason(report).startswith(NOT_APPLICABLE):
            return report
        report.outcome = "failed"
        report.longrepr = (
            f"skipped in CI (CI=true), where a test of the test cluster must run: {skip_reason(report)}. "
            "Run CI as root with iproute2 and a cgroup v1 cpu controller (off CI, without CI=true, it skips)"
        )
    return report
