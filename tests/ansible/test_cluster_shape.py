"""The job's shape rule (plugins/filter/xeonsd_cluster.py): mpi_ranks == nodes x ranks_per_node, the verdict that
preflight, the finetune role and doctor's nodefile row all show."""

from __future__ import annotations

import pytest
from repo_code import ansible_code

xeonsd_cluster = ansible_code("xeonsd_cluster")

NODES = ["node1", "node2", "node3", "node4"]


def test_ranks_that_fit_the_nodes_pass_with_inventory_strings() -> None:
    assert xeonsd_cluster.ranks_mismatch("16", NODES, "4") == ""
    assert xeonsd_cluster.ranks_mismatch(4, NODES, 1) == ""


def test_ranks_that_do_not_fit_name_the_nodes_and_the_total_to_set() -> None:
    assert xeonsd_cluster.ranks_mismatch(15, NODES, 4) == (
        "mpi_ranks is 15 but the cluster has 4 nodes (node1, node2, node3, node4) x ranks_per_node 4 = 16. "
        "Fix: set mpi_ranks to 16 or change ranks_per_node."
    )
    assert xeonsd_cluster.ranks_mismatch(16, NODES[:3], 4).startswith("mpi_ranks is 16 but the cluster has 3 nodes")


def test_bad_input_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="must be integers"):
        xeonsd_cluster.ranks_mismatch("sixteen", NODES, 4)
    with pytest.raises(TypeError, match="list of hosts"):
        xeonsd_cluster.ranks_mismatch(16, "node1", 4)


def test_auto_fits_until_the_finetune_role_resolves_it() -> None:
    assert xeonsd_cluster.ranks_mismatch("auto", NODES, "auto") == ""
    assert xeonsd_cluster.ranks_mismatch(16, NODES, "auto") == ""


def test_probe_targets_are_the_hosts_addresses_and_ports_with_their_defaults() -> None:
    hostvars = {
        "node1": {"ansible_host": "10.0.0.1", "ansible_port": "2222", "mpi_address": "10.1.0.1"},
        "node2": {"mpi_address": "10.1.0.2"},
    }
    assert xeonsd_cluster.probe_targets(["node1", "node2"], hostvars, "ansible_host", "ansible_port", 22) == [
        {"name": "node1", "host": "10.0.0.1", "port": 2222},
        {"name": "node2", "host": "node2", "port": 22},  # as Ansible connects: the inventory name, port 22
    ]
    assert xeonsd_cluster.probe_targets(["node2"], hostvars, "mpi_address", None, "22") == [
        {"name": "node2", "host": "10.1.0.2", "port": 22}
    ]
    with pytest.raises(ValueError, match="node1's port 'ssh' is not a number"):
        xeonsd_cluster.probe_targets(["node1"], {"node1": {"ansible_port": "ssh"}}, "ansible_host", "ansible_port", 22)
    with pytest.raises(TypeError, match="list of hosts"):
        xeonsd_cluster.probe_targets("node1", hostvars, "ansible_host", "ansible_port", 22)
