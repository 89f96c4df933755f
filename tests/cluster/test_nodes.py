"""The test nodes are separate servers where the playbooks can tell: each has a root home of its own, as new."""

from __future__ import annotations

from pathlib import Path

from harness import Cluster
from sshd import SKELETON


def test_each_node_has_a_fresh_root_home_of_its_own(cluster: Cluster) -> None:
    marker = ".xeonsd-test-node-home"
    first, second = cluster.nodes[0], cluster.nodes[1]
    try:
        cluster.ssh(first, f"echo {first} > ~/{marker}")
        # Written on one node: not on another, not on this machine.
        assert cluster.ssh(second, f"test -e ~/{marker}", check=False).returncode == 1
        assert not (Path.home() / marker).exists()
        # A new server's shell start: the distribution's skeleton, not this machine's ~/.bashrc (pyenv init).
        bashrc = cluster.ssh(second, "cat ~/.bashrc; echo; echo HOME=$HOME").stdout
        assert bashrc.startswith((SKELETON / ".bashrc").read_text())
        assert "HOME=/root" in bashrc
        assert "pyenv" not in cluster.ssh(second, "echo $PATH").stdout
    finally:
        cluster.ssh(first, f"rm -f ~/{marker}", check=False)
