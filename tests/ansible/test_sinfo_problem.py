"""The preflight's check of a site's Slurm (roles/preflight/tasks/slurm.yml; plugins/filter/xeonsd_slurm.py,
sinfo_problem): from sinfo's rows on the primary, the partition the job asks for (or Slurm's default) must exist and
hold every node of the inventory by its slurm_node_name; each failure says what is wrong and the fix, sinfo's own
failure first."""

from __future__ import annotations

from repo_code import ansible_code

xeonsd_slurm = ansible_code("xeonsd_slurm")
sinfo_problem = xeonsd_slurm.sinfo_problem

NODES = ["node1", "node2", "node3", "node4"]
# sinfo --noheader --node --format "%P %N": one row a node and partition, the default partition marked "*".
ROWS = ["xeonsd* node1", "xeonsd* node2", "xeonsd* node3", "xeonsd* node4", "big node1", "big node2"]


def sinfo(rows: list[str] = ROWS, rc: int = 0, stderr: str = "") -> dict:
    return {"rc": rc, "stdout_lines": rows, "stderr": stderr}


def test_a_partition_that_holds_every_node_passes_named_or_as_slurms_default() -> None:
    assert sinfo_problem(sinfo(), "xeonsd", NODES, "node1") == ""
    assert sinfo_problem(sinfo(), "", NODES, "node1") == ""  # Slurm's default partition: xeonsd*
    assert sinfo_problem(sinfo(), "big", NODES[:2], "node1") == ""
    assert xeonsd_slurm.parse_sinfo(ROWS) == (
        ["xeonsd", "big"],
        "xeonsd",
        {"xeonsd": NODES, "big": ["node1", "node2"]},
    )


def test_a_failed_sinfo_is_reported_with_its_error_and_the_fix() -> None:
    problem = sinfo_problem(
        sinfo([], rc=1, stderr="slurm_load_partitions: Unable to contact slurm controller\n"), "xeonsd", NODES, "node1"
    )
    assert problem == (
        "sinfo failed on node1: slurm_load_partitions: Unable to contact slurm controller. Fix: check that slurmctld"
        " runs and that this node has its slurm.conf and munge key."
    )


def test_a_partition_slurm_does_not_have_names_slurms_partitions() -> None:
    assert sinfo_problem(sinfo(), "gpu", NODES, "node1") == (
        "Slurm has no partition gpu (its partitions: xeonsd, big). Fix: set slurm_partition to one of them."
    )
    no_default = [r.replace("*", "") for r in ROWS]
    assert sinfo_problem(sinfo(no_default), "", NODES, "node1") == (
        "Slurm has no partition (none: set slurm_partition) (its partitions: xeonsd, big). Fix: set slurm_partition"
        " to one of them."
    )


def test_nodes_slurm_does_not_know_in_the_partition_are_named_once() -> None:
    assert sinfo_problem(sinfo(), "big", [*NODES, "node4"], "node1") == (
        "Slurm does not know node3, node4 in partition big. Fix: set slurm_node_name of these hosts to their Slurm"
        " names (sinfo -N)."
    )
