"""Fixtures for the playbook tests: a real 4-node test cluster (network namespaces, sshd, private mounts).

The cluster lives in .cluster/pytest with its own namespaces (xsdt-*) and subnet (10.231.1.0/24), apart from
a developer's `make cluster-up` cluster; it is removed at the end of the session, also when tests fail.
XEONSD_TEST_CLUSTER_SLOT=N (2-8) gives a second checkout its own namespaces (xsdtN-*) and subnet (10.231.N.0/24),
so two checkouts can run their cluster tests at the same time.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import timings  # noqa: E402
from ci_skips import pytest_runtest_makereport  # noqa: E402, F401 - the hook: in CI, a skip of these tests fails
from harness import NODES, REPO, Cluster  # noqa: E402
from runner import PlaybookRun, run_playbook  # noqa: E402
from shared_runs import ensure_run  # noqa: E402


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("the test cluster needs root and iproute2 (network and mount namespaces)")
    slot = int(os.environ.get("XEONSD_TEST_CLUSTER_SLOT", "1"))
    if not 1 <= slot <= 8:
        pytest.fail(f"XEONSD_TEST_CLUSTER_SLOT={slot}: expected 1-8")
    c = Cluster(REPO / ".cluster" / "pytest", prefix="xsdt" if slot == 1 else f"xsdt{slot}", subnet=slot)
    c.state_dir.mkdir(parents=True, exist_ok=True)
    # One test session at a time on this machine (also from another checkout: the namespaces and the subnet are
    # the same): a second one would tear down (and rebuild) the cluster under the first.
    lock = open(f"/run/xeonsd-test-cluster-{c.prefix}.lock", "w")  # noqa: SIM115 - held for the whole session
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        pytest.fail(f"another pytest session is using the {c.prefix}-* test cluster on this machine; wait for it")
    c.down()  # leftovers of an interrupted session
    try:
        c.make_assets()
        c.up(NODES)
        yield c
    finally:
        c.down()
        lock.close()


@pytest.fixture(scope="session")
def fresh_provision(cluster: Cluster) -> PlaybookRun:
    """`ansible-playbook provision.yml` on the freshly started cluster, once per session."""
    result = run_playbook("provision.yml", cluster.inventory, state_dir=cluster.state_dir, name="fresh-provision")
    print(f"\nfresh provision of {NODES} nodes: {result.seconds:.1f} s wall (log: {result.log})")
    return result


@pytest.fixture
def provisioned(cluster: Cluster, fresh_provision: PlaybookRun) -> Cluster:
    _provision_passed(fresh_provision)
    return cluster


@pytest.fixture(scope="session")
def base_export_run(cluster: Cluster, fresh_provision: PlaybookRun) -> Path:
    """The textual-inversion run "e2e" whose export of the base model later runs reuse: test_finetune_e2e.py's run,
    or a small one made here when that file did not run in this session (tests/cluster/shared_runs.py)."""
    _provision_passed(fresh_provision)
    return ensure_run(cluster, "e2e")


@pytest.fixture(scope="session")
def lora_run(cluster: Cluster, fresh_provision: PlaybookRun) -> Path:
    """The LoRA run "lora" that serve.yml serves: test_finetune_methods.py's run, or a small one made here."""
    _provision_passed(fresh_provision)
    return ensure_run(cluster, "lora", "-e", "finetune_method=lora")


def _provision_passed(fresh_provision: PlaybookRun) -> None:
    if fresh_provision.rc != 0:
        pytest.fail(f"the fresh provision failed (rc={fresh_provision.rc}):\n{fresh_provision.tail()}")


def pytest_sessionfinish(session: pytest.Session) -> None:
    timings.save()
