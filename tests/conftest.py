"""Shared fixtures: the offline tiny Stable Diffusion pipeline and the synthetic image set, built once a session."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
CLUSTER_TESTS = REPO / "tests" / "cluster"

# The suite keeps 2 cores busier than 2 threads: two workers, each test's own processes, ranks beside them. An
# OpenMP thread that finds no work spins (GNU OpenMP's default) on a core another process wants: two 2-thread LoRA
# runs side by side on 2 cores took 0.3 to 7.4 s a step, against 0.12-0.16 s with passive waiting (tiny model, 64 px,
# Zen 4). The threads' count, and so every result, stays as it was. Set here, before any test imports torch; the
# workers, the CLI runs and the local ranks inherit it (the test cluster's nodes have their own environment).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _is_cluster_test(item: pytest.Item) -> bool:
    """A test of the 4-node test cluster (tests/cluster): the xdist group, and the tests that run at nice 0."""
    return CLUSTER_TESTS in item.path.parents


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the group into each test's id
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test`: -n 2 --dist loadgroup) every test of the 4-node test cluster runs in one
    worker, in file order but the bare cluster's tests first: they share one provisioned cluster (a session fixture,
    one cluster per machine), while the other worker runs the rest of the suite."""
    for item in items:
        if _is_cluster_test(item):
            item.add_marker(pytest.mark.xdist_group("test-cluster"))
    # The tests of the bare cluster (preflight's refusals, the inventory) before the session's provision: each
    # compares every node's private files before and after its run, a walk of ~40,000 files per node once the
    # nodes have their environments, and of a few before.
    items.sort(key=lambda item: _is_cluster_test(item) and "fresh_provision" in item.fixturenames)


# CFS weight 335 against nice 0's 1024: the cluster chain gets 3/4 of a core both want. Not more: against the 16
# ranks of a cluster job, a nice-5 test process still gets 1/25 of a core, so the local multi-rank tests' ranks
# stay well inside their wall-clock collective timeouts (at nice 10 it would be 1/75).
BACKGROUND_NICE = 5


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under pytest-xdist the cluster tests are the suite's critical path (one worker runs them one after another,
    the other worker's tests fit beside them): every other test runs at nice BACKGROUND_NICE, and what it starts
    inherits that, so on 2 cores it takes the CPU the cluster's ranks and Ansible leave idle instead of slowing
    them. A cluster test (and the nodes' processes it starts) runs at nice 0. Without xdist nothing changes."""
    if not hasattr(item.config, "workerinput"):
        return
    nice = 0 if _is_cluster_test(item) else BACKGROUND_NICE
    with contextlib.suppress(PermissionError):  # lowering it back needs root; the cluster tests need root anyway
        os.setpriority(os.PRIO_PROCESS, 0, nice)


def _timings():  # noqa: ANN202 - tests/cluster/timings.py, a module of that directory
    sys.path.insert(0, str(CLUSTER_TESTS))
    import timings

    return timings


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist), not a worker
        _timings().load_and_clear()  # figures an interrupted session left


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The wall time of every playbook run of the cluster tests (tests/cluster/timings.py): figures, not assertions."""
    if hasattr(terminalreporter.config, "workerinput"):  # a worker: its summary is not shown; the controller's is
        return
    rows = _timings().load_and_clear()
    if rows:
        terminalreporter.section("playbook wall times (test cluster)")
        for name, seconds in rows:
            terminalreporter.write_line(f"{seconds:8.1f} s  {name}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from xeonsd.assets import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("assets") / "tiny-sd")


@pytest.fixture(scope="session")
def tiny_xl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny SDXL pipeline (two text encoders, a UNet with text_time conditioning; 64 px)."""
    from xeonsd.assets import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("assets") / "tiny-xl", arch="tiny-xl")


@pytest.fixture(scope="session")
def tiny_flux_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny FLUX.1-dev pipeline (CLIP-L + T5, a packed-token transformer with guidance embedding; 64 px)."""
    from xeonsd.assets import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("assets") / "tiny-flux", arch="tiny-flux")


@pytest.fixture(scope="session")
def tiny_sd3_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny SD3.5-style pipeline (CLIP-L, CLIP-G, T5, an MMDiT transformer; 64 px)."""
    from xeonsd.assets import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("assets") / "tiny-sd3", arch="tiny-sd3")


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from xeonsd.assets import make_dataset

    out = tmp_path_factory.mktemp("assets") / "dicoo"
    make_dataset(out, count=5, size=64)
    return out


@pytest.fixture
def cli_env() -> dict[str, str]:
    """Environment for running the xeonsd CLI in a subprocess: offline, quiet, small thread counts."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


# The loss of a 30-step demo run (`make demo-local` flags, 1 rank, tiny model, 128 px), as its metrics.jsonl logged
# it, rounded to 4 decimals: no trend, only the noise of the sampled timesteps.
# a table: rows of literals read better than ruff's one number a line
DEMO_LOSSES = (1.0813, 1.0575, 1.1466, 1.1274, 1.1323, 1.2063, 1.1879, 1.1541, 1.1136, 1.0878, 1.0802, 1.0934, 1.1644,
               1.0768, 1.1264, 1.1558, 1.106, 1.2073, 1.1521, 1.1907, 1.1937, 1.1525, 1.0875, 1.2084, 1.1974, 1.2251,
               1.1886, 1.1221, 1.0897, 1.1191)  # fmt: skip


@pytest.fixture
def demo_metrics() -> list[dict]:
    """The recorded demo run's metrics rows (its losses; the timings made up but of the same kind)."""
    return [
        {
            "step": i + 1,
            "loss": loss,
            "lr": 0.002,
            "s_per_step": 2.4,
            "images_per_s": 0.41,
            "ranks": 1,
            "backend": "none",
            "allreduce_bytes": 132,
        }
        for i, loss in enumerate(DEMO_LOSSES)
    ]
