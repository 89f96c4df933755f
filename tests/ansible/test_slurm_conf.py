"""slurm.conf from the inventory (plugins/filter/xeonsd_slurm_conf.py, the slurm role with slurm_install: true):
each host's node line from its inventory variables or its facts, the controller on the primary, one default
partition, the settings in order, the site's lines last, and one clear refusal per wrong value."""

from __future__ import annotations

import pytest
from repo_code import ansible_code

conf_filter = ansible_code("xeonsd_slurm_conf")

HOSTVARS = {
    "node1": {
        "slurm_node_name": "node1",
        "mpi_address": "10.0.0.11",
        "ansible_facts": {"processor_vcpus": 56, "memtotal_mb": 257000},
    },
    "node2": {
        "slurm_node_name": "cn-2",
        "mpi_address": "10.0.0.12",
        "ansible_facts": {"processor_vcpus": 56, "memtotal_mb": 257000},
    },
    "node3": {
        "slurm_node_name": "node3",
        "mpi_address": "10.0.0.13",
        "slurm_node_cpus": 4,
        "slurm_node_memory_mb": 2048,
    },
}


def _conf(**over) -> dict:
    conf = {
        "cluster_name": "xeonsd",
        "controller": {"name": "node1", "address": "10.0.0.11"},
        "nodes": conf_filter.slurm_nodes(HOSTVARS, ["node1", "node2", "node3"], 1024),
        "partition": "cpu",
        "settings": {"SlurmctldPort": 6817, "AuthType": "auth/munge", "TaskPlugin": "task/affinity"},
        "extra_lines": ["AccountingStorageType=accounting_storage/none"],
    }
    conf.update(over)
    return conf


def test_each_node_comes_from_its_inventory_variables_or_else_its_facts() -> None:
    nodes = conf_filter.slurm_nodes(HOSTVARS, ["node1", "node2", "node3"], 1024)
    assert nodes == [
        {"name": "node1", "address": "10.0.0.11", "cpus": 56, "memory_mb": 255976},
        {"name": "cn-2", "address": "10.0.0.12", "cpus": 56, "memory_mb": 255976},
        {"name": "node3", "address": "10.0.0.13", "cpus": 4, "memory_mb": 2048},  # the inventory's, no reserve
    ]


def test_a_host_without_facts_or_cpus_is_named_with_the_fix() -> None:
    hostvars = {"node4": {"slurm_node_name": "node4", "mpi_address": "10.0.0.14", "slurm_node_memory_mb": 4096}}
    with pytest.raises(
        ValueError, match=r"node4 has no slurm_node_cpus and no gathered processor_vcpus.*without --limit"
    ):
        conf_filter.slurm_nodes(hostvars, ["node4"])
    hostvars["node4"]["slurm_node_cpus"] = 0
    with pytest.raises(ValueError, match="the CPUs of node4 must be a positive integer, got 0"):
        conf_filter.slurm_nodes(hostvars, ["node4"])


def test_the_file_has_the_controller_the_nodes_one_default_partition_and_the_site_s_lines_last() -> None:
    text = conf_filter.slurm_conf(_conf())
    lines = text.splitlines()
    body = [x for x in lines if not x.startswith("#")]
    assert body == [
        "ClusterName=xeonsd",
        "SlurmctldHost=node1(10.0.0.11)",
        "SlurmctldPort=6817",
        "AuthType=auth/munge",
        "TaskPlugin=task/affinity",
        "NodeName=node1 NodeAddr=10.0.0.11 CPUs=56 RealMemory=255976 State=UNKNOWN",
        "NodeName=cn-2 NodeAddr=10.0.0.12 CPUs=56 RealMemory=255976 State=UNKNOWN",
        "NodeName=node3 NodeAddr=10.0.0.13 CPUs=4 RealMemory=2048 State=UNKNOWN",
        "PartitionName=cpu Nodes=node1,cn-2,node3 Default=YES MaxTime=INFINITE State=UP",
        "AccountingStorageType=accounting_storage/none",
    ]
    assert text.endswith("\n")


@pytest.mark.parametrize(
    ("over", "said"),
    [
        ({"partition": "my cpus"}, "partition 'my cpus' is not a Slurm name"),
        ({"cluster_name": "Xeonsd"}, "cluster name 'Xeonsd' must be lower case"),
        ({"controller": {"name": "head node", "address": "10.0.0.1"}}, "controller host name 'head node' is not a"),
        ({"settings": {"TaskPlugin": "task/affinity task/cgroup"}}, "a slurm.conf value has no spaces"),
        ({"nodes": []}, "nodes must be a non-empty list"),
        ({"extra_lines": "AccountingStorageType=x"}, "extra_lines must be a list of lines"),
        ({"extra_lines": ["A=1\nB=2"]}, "one line each"),
    ],
)
def test_a_wrong_value_is_refused_by_name(over: dict, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        conf_filter.slurm_conf(_conf(**over))
    conf = _conf()
    del conf["partition"]
    with pytest.raises(ValueError, match="missing partition"):
        conf_filter.slurm_conf(conf)


def test_two_hosts_with_one_slurm_name_are_refused() -> None:
    nodes = [{"name": "node1", "address": "10.0.0.11", "cpus": 1, "memory_mb": 1}] * 2
    with pytest.raises(ValueError, match="two hosts have the same Slurm name"):
        conf_filter.slurm_conf(_conf(nodes=nodes))
