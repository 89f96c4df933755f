"""Preflight: a wrong inventory or an unfit node stops provision.yml before any node is changed, and the
failure names the host and the fix."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
from ci_skips import not_applicable
from harness import Cluster
from runner import PlaybookRun, run_playbook


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
    # An air-gapped site with the defaults (conda, Diffusers from git) and nothing staged on the controller.
    "offline-conda-nothing-staged": (
        dict(overrides={"python_env_kind": "conda", "diffusers_source": "git"}),
        [
            "offline_install is true and python_env_kind is conda, but the nodes would download Miniforge",
            "Fix: download that installer",
            "set miniforge_installer_source to its path, or set python_env_kind: venv",
        ],
    ),
    "offline-git-nothing-staged": (
        dict(overrides={"diffusers_source": "git"}),
        [
            "offline_install is true and diffusers_source is git, but the controller would clone",
            "Fix: set diffusers_source: sdist",
            "set diffusers_source_archive to its path and diffusers_source_archive_sha256",
        ],
    ),
}


def refused_by_preflight(result: PlaybookRun, expected: list[str]) -> None:
    """Only preflight tasks failed, their messages say every expected text, and no play after preflight began."""
    failures = result.failures()
    assert failures and all(f.task.startswith("preflight : ") for f in failures), failures
    said = " ".join(f.msg for f in failures)
    for text in expected:
        assert text in said, f"{text!r} not in the failed tasks' messages ({result.log}): {failures}"
    assert "Provision every node" not in result.plays(), result.plays()


@pytest.mark.parametrize("case", list(BAD_INVENTORIES))
def test_bad_inventory_fails_in_preflight_and_changes_nothing(cluster: Cluster, tmp_path: Path, case: str) -> None:
    if case == "amx-required-but-missing" and has_amx():
        not_applicable("this machine has AMX")
    kwargs, expected = BAD_INVENTORIES[case]
    inventory = cluster.write_inventory(tmp_path / "inventory.yml", **kwargs)
    before = cluster.snapshot()

    result = run_playbook("provision.yml", inventory, state_dir=cluster.state_dir, name=f"preflight-{case}")

    assert result.rc != 0, f"provision.yml passed with a bad inventory ({case}):\n{result.tail()}"
    refused_by_preflight(result, expected)
    # No node changed.
    assert all(n == 0 for n in result.changed().values()), result.recap
    assert cluster.snapshot() == before


def controller_python() -> str:
    return "{}.{}".format(*sys.version_info[:2])


def staged(tmp_path: Path, name: str, content: bytes) -> tuple[str, str]:
    """A file staged on the controller: (path, sha256)."""
    path = tmp_path / "staged" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(content)
    return str(path), hashlib.sha256(content).hexdigest()


def offline_staged_case(tmp_path: Path, case: str) -> tuple[dict, list[str]]:
    """Offline mode with conda and git and files staged on the controller, one of them wrong per case."""
    installer, installer_sha = staged(tmp_path, "Miniforge3.sh", b"#!/bin/sh\necho not really miniforge\n")
    archive, archive_sha = staged(tmp_path, "diffusers-0.39.0.tar.gz", b"not really diffusers")
    overrides = {
        "python_env_kind": "conda",
        "diffusers_source": "git",
        "miniforge_installer_source": installer,
        "miniforge_sha256": installer_sha,
        "conda_python_version": controller_python(),
        "diffusers_source_archive": archive,
        "diffusers_source_archive_sha256": archive_sha,
    }
    expected: list[str] = []
    if case == "installer-wrong-checksum":
        overrides["miniforge_sha256"] = "0" * 64
        expected = [
            f"{installer} (Miniforge",
            f"has sha256 {installer_sha}; miniforge_sha256 says {'0' * 64}",
            "Fix: stage the right file there (or correct miniforge_installer_source)",
        ]
    elif case == "archive-missing":
        overrides["diffusers_source_archive"] = str(tmp_path / "nowhere.tar.gz")
        expected = [
            f"{tmp_path / 'nowhere.tar.gz'} (Diffusers",
            "does not exist on the controller",
            "Fix: stage the right file there (or correct diffusers_source_archive)",
        ]
    elif case == "conda-python-not-wheelhouse-python":
        overrides["conda_python_version"] = "3.9"
        expected = [
            f"built with the controller's Python {controller_python()} but the conda env gets Python 3.9",
            "Fix: set wheelhouse_python to a Python 3.9 on the controller",
        ]
    return overrides, expected


@pytest.mark.parametrize("case", ["installer-wrong-checksum", "archive-missing", "conda-python-not-wheelhouse-python"])
def test_offline_staged_file_that_does_not_fit_fails_in_preflight(cluster: Cluster, tmp_path: Path, case: str) -> None:
    overrides, expected = offline_staged_case(tmp_path, case)
    inventory = cluster.write_inventory(tmp_path / "inventory.yml", overrides=overrides)
    before = cluster.snapshot()

    result = run_playbook("provision.yml", inventory, state_dir=cluster.state_dir, name=f"preflight-offline-{case}")

    assert result.rc != 0, f"provision.yml passed with {case}:\n{result.tail()}"
    refused_by_preflight(result, expected)
    assert cluster.snapshot() == before


def test_offline_conda_and_git_with_staged_files_pass_preflight(cluster: Cluster, tmp_path: Path) -> None:
    overrides, _ = offline_staged_case(tmp_path, "good")
    inventory = cluster.write_inventory(tmp_path / "inventory.yml", overrides=overrides)
    result = run_playbook("playbooks/preflight.yml", inventory, state_dir=cluster.state_dir, name="preflight-staged")
    assert result.rc == 0, result.tail()
    assert "Check the staged files against their checksums" in result.output
    assert all(n == 0 for n in result.changed().values()), result.recap


def test_good_inventory_passes_preflight(cluster: Cluster) -> None:
    result = run_playbook(
        "playbooks/preflight.yml", cluster.inventory, state_dir=cluster.state_dir, name="preflight-good"
    )
    assert result.rc == 0, result.tail()
    assert set(result.recap) == set(cluster.nodes)
    assert all(n == 0 for n in result.changed().values()), result.recap
    if not has_amx():
        assert "has no AMX (amx_bf16, amx_tile): bf16 runs without AMX acceleration" in " ".join(result.output.split())
