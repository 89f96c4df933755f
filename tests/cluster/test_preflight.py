"""Preflight: a wrong inventory or an unfit node stops provision.yml before any node is changed, and the
failure names the host and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import Cluster
from runner import run_playbook


def has_amx() -> bool:
    flags = Path("/proc/cpuinfo").read_text().split()
    return "amx_bf16" in flags and "amx_tile" in flags


BAD_INVENTORIES = {
    "two-primaries": (
        dict(primaries=["node1", "node2"]),
        ["2 hosts in group primary (node1, node2)", "Fix: put exactly one host under primary"],
    ),
    "duplicate-address": (
        dict(host_overrides={"node4": {"ansible_host": "10.231.1.13"}}),
        ["node3 and node4 have the same address 10.231.1.13", "Fix: give each node its own ansible_host"],
    ),
    "ranks-not-nodes-times-ppn": (
        dict(overrides={"mpi_ranks": 15}),
        ["mpi_ranks is 15 but the cluster has 4 nodes", "x ranks_per_node 4 = 16", "Fix: set mpi_ranks to 16"],
    ),
    "unreachable-node": (
        # Nothing listens on this port of node4's own address: connection refused.
        dict(host_overrides={"node4": {"ansible_port": 2222}}),
        ["node4", "(10.231.1.14:2222)", "does not answer on SSH from the controller", "Fix: start"],
    ),
    "ranks-per-node-above-physical-cores": (
        dict(overrides={"ranks_per_node": 1024, "mpi_ranks": 4096, "preflight_allow_oversubscribe": False}),
        ["physical cores", "but ranks_per_node is 1024", "Fix: lower ranks_per_node"],
    ),
    "amx-required-but-missing": (
        dict(overrides={"require_amx": True}),
        ["has no AMX (amx_bf16, amx_tile)", "Fix: use 4th-gen Xeon"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_INVENTORIES))
def test_bad_inventory_fails_in_preflight_and_changes_nothing(cluster: Cluster, tmp_path: Path, case: str) -> None:
    if case == "amx-required-but-missing" and has_amx():
        pytest.skip("this machine has AMX")
    kwargs, expected = BAD_INVENTORIES[case]
    inventory = cluster.write_inventory(tmp_path / "inventory.yml", **kwargs)
    before = cluster.snapshot()

    result = run_playbook("provision.yml", inventory, state_dir=cluster.state_dir, name=f"preflight-{case}")

    assert result.rc != 0, f"provision.yml passed with a bad inventory ({case}):\n{result.tail()}"
    for text in expected:
        assert text in " ".join(result.output.split()), f"{text!r} not in the output ({result.log}):\n{result.tail()}"
    # Nothing but preflight ran, and no node changed.
    assert "PLAY [Provision every node]" not in result.output
    assert all(n == 0 for n in result.changed().values()), result.recap
    assert cluster.snapshot() == before


def test_good_inventory_passes_preflight(cluster: Cluster) -> None:
    result = run_playbook(
        "playbooks/preflight.yml", cluster.inventory, state_dir=cluster.state_dir, name="preflight-good"
    )
    assert result.rc == 0, result.tail()
    assert set(result.recap) == set(cluster.nodes)
    assert all(n == 0 for n in result.changed().values()), result.recap
    if not has_amx():
        assert "has no AMX (amx_bf16, amx_tile): bf16 runs without AMX acceleration" in " ".join(result.output.split())
