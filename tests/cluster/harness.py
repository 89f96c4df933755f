"""A real multi-node test cluster on one machine.

Each node is a network namespace with its own address on a private bridge and its own ``sshd``, started inside a
private mount namespace in which the node's directories (the env, the cluster user's home, the cluster
configuration, /etc/ssh with the node's own host key) are bind mounts of per-node directories under the state
directory: nodes do not see each other's files, like separate servers (unless they share the home: shared_home.py).
They share the host's /usr and Debian package database, as the issue describes; the OS packages the roles install
are installed on the host first (the nodes' "base image"), because the nodes have no route to a package mirror.

    python tests/cluster/harness.py up --nodes 4      # writes .cluster/inventory.yml
    python tests/cluster/harness.py down              # removes every namespace, process, link and node dir

The controller (ansible-playbook on the host) reaches the nodes over real SSH through the bridge, which has the
first address of the subnet. Only addresses of this private subnet are ever used.

This file holds the CLI and `Cluster`, which puts the pieces together and records what it made (state.json);
the pieces are, by concern:
    host.py               commands on the host; its /usr as the nodes' shared OS, the cluster account
    namespaces.py         network and mount namespaces, the nodes' loop-mounted disk, stopping processes
    sshd.py               each node's /etc/ssh, host key and sshd; SSH from the controller
    cluster_inventory.py  the nodes' paths read from inventory/group_vars/all, the settings in
                          group_vars/cluster.yml (next to this file), the inventory directory a run writes
    assets.py             the images, the tiny model and the train/ snapshot the playbooks stage
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

from assets import make_assets
from cluster_inventory import (
    REPO,
    cluster_user,
    cluster_user_home,
    load_settings,
    node_private_dirs,
    slurm_node_dirs,
    slurm_spool_dir,
    write_inventory_dir,
)
from host import ensure_base_image
from namespaces import (
    add_bridge,
    add_namespace,
    kill_group,
    mount_disk,
    namespaces_named,
    remove_link,
    remove_namespace,
    tree_stats,
    unmount_disk,
)
from shared_home import switch_home
from slurm import SlurmCluster, role_daemon_pids, stopped_munged
from sshd import (
    ADMIN_HOME,
    NODE_SYSTEM_DIRS,
    close_control_masters,
    make_ed25519_key,
    prepare_admin_home,
    prepare_etc_ssh,
    ssh_argv,
    start_sshd,
    wait_for_port,
)

__all__ = ["NODES", "REPO", "Cluster", "State", "main"]

# Nodes of the test cluster the playbook tests use (the recipe's 4).
NODES = 4
# Size of the sparse disk image that holds every node's private directories (GiB; only what is used is stored).
DISK_GB = 40


def physical_cores() -> int:
    """This machine's physical cores (one per core: hyper-threads not counted), which every node shares."""
    seen = set()
    for cpu in os.sched_getaffinity(0):
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            seen.add((int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text())))
        except (OSError, ValueError):
            seen.add((0, cpu))
    return len(seen)


@dataclass
class State:
    """What `up` made, so that `down` removes exactly that (also after a crash half-way)."""

    prefix: str
    subnet: int
    nodes: list[str] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)
    created_dirs: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    shared_home: bool = False  # one home for every node (share_home)


class Cluster:
    """N nodes named node1..nodeN; node1 is the primary."""

    def __init__(self, state_dir: Path = REPO / ".cluster", prefix: str = "xsd", subnet: int = 0) -> None:
        self.state_dir = Path(state_dir).resolve()
        self.prefix = prefix
        self.subnet = subnet
        self.bridge = f"{prefix}-br"
        self.shared_home_dir = self.state_dir / "nodes" / "shared-home"  # the home of every node (share_home)
        self.admin_key = self.state_dir / "id_ed25519"  # the controller's SSH key
        self.known_hosts = self.state_dir / "known_hosts"
        self.state_file = self.state_dir / "state.json"
        self.disk_image = self.state_dir / "disk.img"  # every node's private directories

    # --- addresses and paths -------------------------------------------------------------------------------
    def address(self, index: int) -> str:
        return f"10.231.{self.subnet}.{10 + index}"

    @property
    def bridge_address(self) -> str:
        return f"10.231.{self.subnet}.1"

    @property
    def inventory(self) -> Path:
        return self.state_dir / "inventory.yml"

    @property
    def control_path_dir(self) -> Path:
        """Ansible's SSH connection sharing per cluster, so `down` can close exactly these connections."""
        return self.state_dir / "cp"

    @cached_property
    def private_dirs(self) -> tuple[str, ...]:
        """The directories each node keeps to itself (/opt/diffuser, /home/devcloud, ...): read from the
        repository's inventory (paths.yml, cluster.yml) and the test cluster's settings."""
        return node_private_dirs()

    @cached_property
    def node_dirs(self) -> tuple[str, ...]:
        """Every directory a node keeps to itself: private_dirs, and the slurm role's (its daemons write there)."""
        return (*self.private_dirs, *slurm_node_dirs())

    def node_dir(self, node: str) -> Path:
        return self.state_dir / "nodes" / node

    def private_dir(self, node: str, path: str) -> Path:
        """The host-side directory that is `path` inside `node` (the shared home's, in shared-home mode)."""
        if path == cluster_user_home() and (state := self.load_state()) and state.shared_home:
            return self.shared_home_dir
        return self.node_dir(node) / "private" / path.lstrip("/")

    def load_state(self) -> State | None:
        if not self.state_file.exists():
            return None
        return State(**json.loads(self.state_file.read_text()))

    def _save(self, state: State) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(state), indent=2))
        tmp.replace(self.state_file)

    @property
    def nodes(self) -> list[str]:
        state = self.load_state()
        return state.nodes if state else []

    # --- up ----------------------------------------------------------------------------------------------------
    def up(self, n: int) -> None:
        """Start nodes node1..node<n>, each in its namespaces with its own sshd, and write the inventory.
        What it makes is recorded in the state file before it is made, or is found by its name (the namespaces,
        the bridge, the disk), so that `down` removes it also after a crash half-way."""
        if n < 1:
            raise ValueError("a cluster needs at least one node")
        if self.load_state() is not None:
            raise RuntimeError(f"a cluster is already up in {self.state_dir}; run `make cluster-down` first")
        ensure_base_image(cluster_user(), cluster_user_home())
        state = State(prefix=self.prefix, subnet=self.subnet)
        self._save(state)  # from here on, `down` can clean up whatever exists
        if not self.admin_key.exists():
            make_ed25519_key(self.admin_key, "xeonsd-test-controller")
        (self.state_dir / "admin_authorized_keys").write_text(self.admin_key.with_suffix(".pub").read_text())
        os.chmod(self.state_dir / "admin_authorized_keys", 0o644)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        mount_disk(self.disk_image, self.state_dir / "nodes", DISK_GB)

        state.links.append(self.bridge)
        self._save(state)
        add_bridge(self.bridge, f"{self.bridge_address}/24")

        # The private directories' mount points on the host: made (empty) where missing; `down` removes those.
        for d in self.node_dirs:
            if not Path(d).exists():
                Path(d).mkdir(parents=True)
                state.created_dirs.append(d)
        self._save(state)

        known = []
        for i in range(1, n + 1):
            node = f"node{i}"
            ns = f"{self.prefix}-{node}"
            state.nodes.append(node)
            state.namespaces.append(ns)
            self._save(state)
            add_namespace(ns, veth=f"{self.prefix}-v{i}", bridge=self.bridge, cidr=f"{self.address(i)}/24")
            host_key = self._prepare_node_dir(node, self.address(i))
            mounts = [(self.private_dir(node, d), d) for d in (*self.node_dirs, *NODE_SYSTEM_DIRS)]
            state.pids[node] = start_sshd(ns, mounts, self.node_dir(node) / "sshd.log")
            self._save(state)
            known.append(f"{self.address(i)} {' '.join(host_key.split()[:2])}")

        self.known_hosts.write_text("\n".join(known) + "\n")
        for i, node in enumerate(state.nodes, start=1):
            wait_for_port(self.address(i), 22, timeout=20, what=f"sshd of {node}")
        self.write_inventory(self.inventory)

    def _prepare_node_dir(self, node: str, address: str) -> str:
        """The node's private directories and its /etc/ssh (own host key, own sshd_config). Returns the host key."""
        nd = self.node_dir(node)
        if nd.exists():
            shutil.rmtree(nd)
        for d in self.node_dirs:
            self.private_dir(node, d).mkdir(parents=True)
        prepare_admin_home(self.private_dir(node, ADMIN_HOME))
        return prepare_etc_ssh(
            self.private_dir(node, "/etc/ssh"),
            node=node,
            address=address,
            admin_authorized_keys=self.state_dir / "admin_authorized_keys",
        )

    def write_inventory(
        self,
        path: Path,
        *,
        nodes: list[str] | None = None,
        overrides: dict | None = None,
        host_overrides: dict[str, dict] | None = None,
        primaries: list[str] | None = None,
    ) -> Path:
        """Write an inventory directory for this cluster: inventory.yml + group_vars.

        group_vars/all is the repository's inventory/group_vars/all (a symlink, so the defaults are the real
        ones); group_vars/cluster.yml holds what differs on the test cluster: the settings of
        tests/cluster/group_vars/cluster.yml and the values of this run. The keyword arguments make deliberately
        wrong inventories for the preflight tests.
        """
        state = self.load_state()
        assert state is not None, "cluster is not up"
        nodes = nodes or state.nodes
        primaries = primaries or nodes[:1]

        def host(node: str) -> dict:
            hv = {"ansible_host": self.address(int(node.removeprefix("node")))}
            hv.update((host_overrides or {}).get(node, {}))
            return hv

        settings = load_settings()
        cluster_vars = {
            **settings,
            # Connection: the harness's key, host keys checked against the harness's known_hosts.
            "ansible_ssh_private_key_file": str(self.admin_key),
            "ansible_ssh_common_args": f"-o UserKnownHostsFile={self.known_hosts} -o IdentitiesOnly=yes",
            "ansible_control_path_dir": str(self.control_path_dir),
            # What the harness made on the controller (make_assets) and the controller's cache.
            "dataset_source_dir": str(self.assets_dir / "dicoo"),
            "base_model_source_dir": str(self.assets_dir / "tiny-sd"),
            "ml_stack_xeonsd_source": str(self.xeonsd_source),
            "controller_cache_dir": str(REPO / ".cache"),
            "mpi_ranks": settings["ranks_per_node"] * len(nodes),
            # Every node is a namespace of this machine: they share its physical cores (the trainer's CPU verdict).
            "cluster_shared_cores": physical_cores(),
            **(overrides or {}),
        }
        return write_inventory_dir(
            Path(path),
            primaries={n: host(n) for n in nodes if n in primaries},
            workers={n: host(n) for n in nodes if n not in primaries},
            cluster_vars=cluster_vars,
        )

    # --- assets ------------------------------------------------------------------------------------------------
    @property
    def assets_dir(self) -> Path:
        return self.state_dir / "assets"

    @property
    def xeonsd_source(self) -> Path:
        return self.assets_dir / "xeonsd-source" / "train"

    def make_assets(self) -> None:
        """The stand-ins for the dicoo images and the base model, and a snapshot of train/ (assets.py)."""
        make_assets(self.assets_dir, self.xeonsd_source)

    # --- using the nodes ---------------------------------------------------------------------------------------
    def ssh(
        self, node: str, command: str, *, user: str = "root", check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess:
        """Run a shell command on a node over real SSH, as the controller does."""
        state = self.load_state()
        assert state is not None
        i = state.nodes.index(node) + 1
        argv = ssh_argv(
            key=self.admin_key, known_hosts=self.known_hosts, destination=f"{user}@{self.address(i)}", command=command
        )
        return subprocess.run(argv, text=True, capture_output=True, check=check, timeout=timeout)

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """Every file and directory in every node's private directories, with its size and mtime."""
        return tree_stats({f"{node}:{d}": self.private_dir(node, d) for node in self.nodes for d in self.private_dirs})

    def share_home(self, shared: bool = True) -> None:
        """Switch the running cluster to one (empty) shared home, or back to each node's own (shared_home.py)."""
        state = self.load_state()
        assert state is not None, "cluster is not up"
        state.shared_home = switch_home({n: state.pids[n] for n in state.nodes}, self.shared_home_dir, shared=shared)
        self._save(state)

    # --- Slurm (finetune_launcher=slurm) ----------------------------------------------------------------------
    @property
    def slurm(self) -> SlurmCluster:
        return SlurmCluster(self.state_dir / "slurm", address=self.bridge_address, slot=self.subnet)

    def record(self, pids: dict[str, int]) -> None:
        """Processes started on the nodes by a playbook (the slurm role's daemons), stopped by `down` too."""
        state = self.load_state()
        assert state is not None, "cluster is not up"
        state.pids.update(pids)
        self._save(state)

    # --- down --------------------------------------------------------------------------------------------------
    def down(self) -> None:
        """Remove everything `up` made; safe to call on a half-made or already removed cluster."""
        state = self.load_state() or State(prefix=self.prefix, subnet=self.subnet)
        # The recorded namespaces, and those of ours that a crashed run did not get to record.
        namespaces = set(state.namespaces) | namespaces_named(f"{self.prefix}-node")
        close_control_masters(self.control_path_dir)
        # The slurm role's daemons (provision.yml with slurm_install: true), from their pid files on the nodes.
        spool = slurm_spool_dir()
        pids = {**role_daemon_pids(state.nodes, lambda node: self.private_dir(node, spool)), **state.pids}
        for ns in sorted(namespaces):
            remove_namespace(ns)
        for pid in pids.values():
            kill_group(pid)
        if "slurm-munged" in pids:
            stopped_munged()
        for link in {*state.links, self.bridge}:
            remove_link(link)
        for d in state.created_dirs:
            with contextlib.suppress(OSError):
                Path(d).rmdir()
        unmount_disk(self.disk_image, self.state_dir / "nodes")
        for name in ("inventory.yml", "known_hosts", "admin_authorized_keys", "state.json"):
            (self.state_dir / name).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state", default=str(REPO / ".cluster"), help="state directory (default .cluster)")
    parser.add_argument("--prefix", default="xsd", help="name prefix of namespaces and links")
    parser.add_argument("--subnet", type=int, default=0, help="third octet of 10.231.X.0/24")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start N nodes and write <state>/inventory.yml")
    up.add_argument("--nodes", type=int, default=4)
    up.add_argument("--shared-home", action="store_true", help="one host directory as every node's home")
    sub.add_parser("down", help="remove every namespace, process, link and node directory")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("the test cluster needs root (network and mount namespaces)", file=sys.stderr)
        return 2
    cluster = Cluster(Path(args.state), prefix=args.prefix, subnet=args.subnet)
    if args.command == "up":
        try:
            cluster.make_assets()
            cluster.up(args.nodes)
            cluster.share_home(args.shared_home)
        except Exception:
            cluster.down()
            raise
        print(f"{args.nodes} nodes up; inventory: {cluster.inventory}")
        print(f"provision: ansible-playbook -i {cluster.inventory} provision.yml")
    else:
        cluster.down()
        print("cluster down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
