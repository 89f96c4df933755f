"""The test cluster's shared-home mode: one host directory bind-mounted as the cluster account's home on every node,
like an NFS home on a real cluster (docs/test-cluster.md#shared-home).

`Cluster.share_home()` (`switch_home`; `harness.py up --shared-home`) switches a running cluster to it (a bind mount over the home in each node's mount namespace, so the sshd sessions, and with them
Ansible and mpirun, see it) and back (the node's own home underneath is untouched). Slurm's slurmd keeps the home
it started with.
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path

from cluster_inventory import cluster_user, cluster_user_home
from host import run

__all__ = ["make_shared_home", "switch_home"]


def make_shared_home(path: Path, user: str) -> Path:
    """The shared home's directory on the host, owned by `user` (the account every node has) with mode 0750."""
    account = pwd.getpwnam(user)
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, account.pw_uid, account.pw_gid)
    path.chmod(0o750)
    return path


def _in_node(pid: int, argv: list[str]) -> None:
    run(["nsenter", "--target", str(pid), "--mount", "--", *argv])


def switch_home(pids: dict[str, int], source: Path, *, shared: bool) -> bool:
    """Bind-mount `source` (made if missing) at the cluster account's home in each node's mount namespace (pids:
    node -> its sshd), or remove that mount again (shared=False; the mount underneath is the node's own home).
    Returns `shared`, the harness state's record of the mode."""
    home = cluster_user_home()
    for pid in pids.values():
        mounted = _mounts(pid).count(f" {home} ") > 1  # the node's own home, and the shared one on top
        if shared and not mounted:
            _in_node(pid, ["mount", "--bind", str(make_shared_home(source, cluster_user())), home])
        elif not shared and mounted:
            _in_node(pid, ["umount", "--lazy", home])  # a job's process left in the home keeps it busy
    return shared


def _mounts(pid: int) -> str:
    return Path(f"/proc/{pid}/mounts").read_text()
