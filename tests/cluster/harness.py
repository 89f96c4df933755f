"""A real multi-node test cluster on one machine.

Each node is a network namespace with its own address on a private bridge and its own ``sshd``, started
inside a private mount namespace in which the node's directories (the env, the cluster user's home, the
cluster configuration, /etc/ssh with the node's own host key) are bind mounts of per-node directories under
the state directory: nodes do not see each other's files, like separate servers. They share the host's
/usr and Debian package database, as the issue describes; the OS packages the roles install are installed
on the host first (the nodes' "base image"), because the nodes have no route to a package mirror.

    python tests/cluster/harness.py up --nodes 4      # writes .cluster/inventory.yml
    python tests/cluster/harness.py down              # removes every namespace, process, link and node dir

The controller (ansible-playbook on the host) reaches the nodes over real SSH through the bridge, which has
the first address of the subnet. Only addresses of this private subnet are ever used.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent

# Node directories that are private to each node (bind mounts in its mount namespace). They match
# inventory/group_vars/all/paths.yml and cluster.yml; /etc/ssh is private too (the node's own host key).
PRIVATE_DIRS = ("/opt/diffuser", "/home/devcloud", "/etc/xeonsd", "/var/cache/xeonsd")
CLUSTER_USER = "devcloud"
# Nodes of the test cluster the playbook tests use (the recipe's 4).
NODES = 4
# Size of the sparse disk image that holds every node's private directories (GiB; only what is used is stored).
DISK_GB = 40
# What every node needs before Ansible can reach it (besides the roles' own OS packages).
BASE_PACKAGES = ("openssh-server", "sudo", "python3", "python3-apt", "iproute2", "util-linux")


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


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=True, text=True, capture_output=True, **kwargs)


class Cluster:
    """N nodes named node1..nodeN; node1 is the primary."""

    def __init__(self, state_dir: Path = REPO / ".cluster", prefix: str = "xsd", subnet: int = 0) -> None:
        self.state_dir = Path(state_dir).resolve()
        self.prefix = prefix
        self.subnet = subnet
        self.bridge = f"{prefix}-br"

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
    def admin_key(self) -> Path:
        return self.state_dir / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.state_dir / "known_hosts"

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.json"

    def node_dir(self, node: str) -> Path:
        return self.state_dir / "nodes" / node

    def private_dir(self, node: str, path: str) -> Path:
        """The host-side directory that is `path` inside `node`."""
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
        if n < 1:
            raise ValueError("a cluster needs at least one node")
        if self.load_state() is not None:
            raise RuntimeError(f"a cluster is already up in {self.state_dir}; run `make cluster-down` first")
        ensure_base_image()
        state = State(prefix=self.prefix, subnet=self.subnet)
        self._save(state)  # from here on, `down` can clean up whatever exists
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if not self.admin_key.exists():
            make_ed25519_key(self.admin_key, "xeonsd-test-controller")
        (self.state_dir / "admin_authorized_keys").write_text(self.admin_key.with_suffix(".pub").read_text())
        os.chmod(self.state_dir / "admin_authorized_keys", 0o644)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        self._mount_disk()

        run(["ip", "link", "add", self.bridge, "type", "bridge"])
        state.links.append(self.bridge)
        self._save(state)
        run(["ip", "addr", "add", f"{self.bridge_address}/24", "dev", self.bridge])
        run(["ip", "link", "set", self.bridge, "up"])

        for d in PRIVATE_DIRS:
            if not Path(d).exists():
                Path(d).mkdir(parents=True)
                state.created_dirs.append(d)
        self._save(state)

        known = []
        for i in range(1, n + 1):
            node = f"node{i}"
            ns = f"{self.prefix}-{node}"
            state.nodes.append(node)
            run(["ip", "netns", "add", ns])
            state.namespaces.append(ns)
            self._save(state)
            veth = f"{self.prefix}-v{i}"
            run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            run(["ip", "link", "set", veth, "master", self.bridge, "up"])
            run(["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0"])
            run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            run(["ip", "-n", ns, "link", "set", "lo", "up"])
            host_key = self._prepare_node_dir(node, self.address(i))
            state.pids[node] = self._start_sshd(node, ns)
            self._save(state)
            known.append(f"{self.address(i)} {' '.join(host_key.split()[:2])}")

        self.known_hosts.write_text("\n".join(known) + "\n")
        for i, node in enumerate(state.nodes, start=1):
            wait_for_port(self.address(i), 22, timeout=20, what=f"sshd of {node}")
        self.write_inventory(self.inventory)

    @property
    def disk_image(self) -> Path:
        return self.state_dir / "disk.img"

    def _mount_disk(self) -> None:
        """The nodes' disks: one sparse ext4 image, loop-mounted at <state>/nodes without discard, so wiping a
        node or the whole cluster is quick (the host filesystem discards every freed block one by one)."""
        nodes = self.state_dir / "nodes"
        if nodes.exists():
            shutil.rmtree(nodes)
        nodes.mkdir(parents=True)
        self.disk_image.unlink(missing_ok=True)
        with open(self.disk_image, "wb") as f:
            f.truncate(DISK_GB << 30)
        run(["mkfs.ext4", "-q", "-F", "-E", "nodiscard", "-m", "0", str(self.disk_image)])
        run(["mount", "-o", "loop,nodiscard", str(self.disk_image), str(nodes)])

    def _prepare_node_dir(self, node: str, address: str) -> str:
        """The node's private directories and its /etc/ssh (own host key, own sshd_config). Returns the host key."""
        nd = self.node_dir(node)
        if nd.exists():
            shutil.rmtree(nd)
        for d in PRIVATE_DIRS:
            self.private_dir(node, d).mkdir(parents=True)
        etc_ssh = self.private_dir(node, "/etc/ssh")
        etc_ssh.mkdir(parents=True)
        for name in ("ssh_config", "moduli"):
            if Path("/etc/ssh", name).exists():
                shutil.copy2(Path("/etc/ssh", name), etc_ssh / name)
        if Path("/etc/ssh/ssh_config.d").is_dir():
            shutil.copytree("/etc/ssh/ssh_config.d", etc_ssh / "ssh_config.d")
        make_ed25519_key(etc_ssh / "ssh_host_ed25519_key", f"root@{node}")
        # The controller's key, inside the node's own /etc/ssh: sshd's StrictModes refuses a key file anywhere
        # below a group- or world-writable directory, such as a checkout under /tmp.
        shutil.copy2(self.state_dir / "admin_authorized_keys", etc_ssh / "admin_authorized_keys")
        os.chmod(etc_ssh, 0o755)
        (etc_ssh / "sshd_config").write_text(
            f"""# sshd of test node {node} (tests/cluster/harness.py)
ListenAddress {address}
Port 22
HostKey /etc/ssh/ssh_host_ed25519_key
PidFile none
UsePAM no
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
AuthorizedKeysFile .ssh/authorized_keys /etc/ssh/admin_authorized_keys
StrictModes yes
MaxStartups 200:30:400
MaxSessions 200
Subsystem sftp internal-sftp
AcceptEnv LANG LC_*
LogLevel INFO
"""
        )
        return (etc_ssh / "ssh_host_ed25519_key.pub").read_text()

    def _start_sshd(self, node: str, ns: str) -> int:
        mounts = [(self.private_dir(node, d), d) for d in (*PRIVATE_DIRS, "/etc/ssh")]
        script = " && ".join(f"mount --bind '{src}' '{dst}'" for src, dst in mounts)
        script += " && exec /usr/sbin/sshd -D -e -f /etc/ssh/sshd_config"
        log = open(self.node_dir(node) / "sshd.log", "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "--",
                "/bin/sh",
                "-c",
                script,
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        return proc.pid

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
        ones); group_vars/cluster.yml holds what differs on the test cluster. The keyword arguments make
        deliberately wrong inventories for the preflight tests.
        """
        state = self.load_state()
        assert state is not None, "cluster is not up"
        nodes = nodes or state.nodes
        primaries = primaries or nodes[:1]
        inv_dir = Path(path).parent
        (inv_dir / "group_vars").mkdir(parents=True, exist_ok=True)
        link = inv_dir / "group_vars" / "all"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(REPO / "inventory" / "group_vars" / "all")

        def host(node: str) -> dict:
            hv = {"ansible_host": self.address(int(node.removeprefix("node")))}
            hv.update((host_overrides or {}).get(node, {}))
            return hv

        inventory = {
            "all": {
                "children": {
                    "cluster": {
                        "children": {
                            "primary": {"hosts": {n: host(n) for n in nodes if n in primaries}},
                            "workers": {"hosts": {n: host(n) for n in nodes if n not in primaries}},
                        }
                    }
                }
            }
        }
        ppn = 4
        cluster_vars = {
            # Connection: root with the harness's key, host keys checked against the harness's known_hosts.
            "ansible_user": "root",
            "ansible_ssh_private_key_file": str(self.admin_key),
            "ansible_ssh_common_args": f"-o UserKnownHostsFile={self.known_hosts} -o IdentitiesOnly=yes",
            "ansible_python_interpreter": "/usr/bin/python3",
            # SSH connection sharing per cluster, so `down` can close exactly these connections.
            "ansible_control_path_dir": str(self.state_dir / "cp"),
            "ansible_become_method": "sudo",
            # The test cluster: venv (no conda channel reachable), Diffusers from the PyPI sdist (no git
            # hosting reachable), offline install from the controller's wheelhouse.
            "python_env_kind": "venv",
            "diffusers_source": "sdist",
            # CPU torch comes from this machine's pip configuration (no PyTorch index is reachable here).
            "ml_stack_extra_index_urls": [],
            "offline_install": True,
            # Nodes have no route to a package mirror; the harness installed the packages on the shared /usr.
            "system_packages_update_cache": False,
            "dataset_source_dir": str(self.assets_dir / "dicoo"),
            "base_model_id": "xeonsd/tiny-sd",
            "base_model_source_dir": str(self.assets_dir / "tiny-sd"),
            "ranks_per_node": ppn,
            "mpi_ranks": ppn * len(nodes),
            # 4 ranks per node on a 2-core machine: oversubscribed on purpose.
            "preflight_allow_oversubscribe": True,
            "preflight_min_memory_mb": 1024,
            "preflight_min_free_disk_mb": 4096,
            "controller_cache_dir": str(REPO / ".cache"),
            "ml_stack_xeonsd_source": str(self.xeonsd_source),
            # The training job (finetune.yml, doctor.yml's one-step trial) sized for the tiny model on 2 cores:
            # small images, fp32 unless the CPU has bf16, few steps.
            "finetune_resolution": 128,
            "finetune_mixed_precision": "auto",
            "finetune_max_train_steps": 30,
            "finetune_checkpointing_steps": 10,
            "finetune_poll_s": 5,
        }
        cluster_vars.update(overrides or {})
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text("---\n# Test cluster inventory (tests/cluster/harness.py).\n" + yaml.safe_dump(inventory))
        tmp.replace(path)
        (inv_dir / "group_vars" / "cluster.yml").write_text(
            "---\n# What differs on the test cluster (tests/cluster/harness.py).\n"
            + yaml.safe_dump(cluster_vars, sort_keys=False)
        )
        return Path(path)

    # --- assets ------------------------------------------------------------------------------------------------
    @property
    def assets_dir(self) -> Path:
        return self.state_dir / "assets"

    @property
    def xeonsd_source(self) -> Path:
        return self.assets_dir / "xeonsd-source" / "train"

    def make_assets(self) -> None:
        """The stand-ins for the dicoo images and the base model, made on the controller with the xeonsd CLI,
        and a snapshot of train/ (the package the nodes get), so that edits in the working tree during a test
        session do not count as changes between two runs."""
        if self.xeonsd_source.exists():
            shutil.rmtree(self.xeonsd_source)
        shutil.copytree(
            REPO / "train",
            self.xeonsd_source,
            ignore=shutil.ignore_patterns(".*", "__pycache__", "*.egg-info", "build", "*.pyc"),
        )
        xeonsd = str(VENV_BIN / "xeonsd")
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        # The images come with captions (metadata.jsonl): the dataset role stages them, every method trains on them.
        if not (self.assets_dir / "dicoo" / "metadata.jsonl").exists():
            shutil.rmtree(self.assets_dir / "dicoo", ignore_errors=True)
            shutil.rmtree(self.assets_dir / "dicoo.partial", ignore_errors=True)
            run([xeonsd, "make-dataset", str(self.assets_dir / "dicoo.partial"), "--captions", "metadata"], env=env)
            (self.assets_dir / "dicoo.partial").rename(self.assets_dir / "dicoo")
        if not (self.assets_dir / "tiny-sd").exists():
            run([xeonsd, "make-tiny-model", str(self.assets_dir / "tiny-sd.partial")], env=env)
            (self.assets_dir / "tiny-sd.partial").rename(self.assets_dir / "tiny-sd")

    # --- using the nodes ---------------------------------------------------------------------------------------
    def ssh(
        self, node: str, command: str, *, user: str = "root", check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess:
        """Run a shell command on a node over real SSH, as the controller does."""
        state = self.load_state()
        assert state is not None
        i = state.nodes.index(node) + 1
        argv = [
            "ssh",
            "-i",
            str(self.admin_key),
            "-o",
            f"UserKnownHostsFile={self.known_hosts}",
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=yes",
            f"{user}@{self.address(i)}",
            command,
        ]
        return subprocess.run(argv, text=True, capture_output=True, check=check, timeout=timeout)

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """Every file and directory in every node's private directories, with its size and mtime."""
        seen: dict[str, tuple[int, int]] = {}
        for node in self.nodes:
            for d in PRIVATE_DIRS:
                root = self.private_dir(node, d)
                for dirpath, dirnames, filenames in os.walk(root):
                    for name in dirnames + filenames:
                        st = Path(dirpath, name).lstat()
                        seen[f"{node}:{d}/{Path(dirpath, name).relative_to(root)}"] = (st.st_size, st.st_mtime_ns)
        return seen

    # --- down --------------------------------------------------------------------------------------------------
    def down(self) -> None:
        """Remove everything `up` made; safe to call on a half-made or already removed cluster."""
        state = self.load_state() or State(prefix=self.prefix, subnet=self.subnet)
        namespaces = set(state.namespaces)
        # Namespaces of ours that a crashed run did not get to record.
        listed = subprocess.run(["ip", "netns", "list"], text=True, capture_output=True).stdout.split()
        namespaces |= {n for n in listed if n.startswith(f"{self.prefix}-node")}
        # SSH control masters of Ansible's connections to these nodes (only ours: their sockets are here).
        for sock in (self.state_dir / "cp").glob("*") if (self.state_dir / "cp").is_dir() else []:
            subprocess.run(["ssh", "-O", "exit", "-o", f"ControlPath={sock}", "node"], capture_output=True, timeout=10)
        for ns in sorted(namespaces):
            kill_namespace(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for pid in state.pids.values():
            kill_group(pid)
        for link in {*state.links, self.bridge}:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for d in state.created_dirs:
            with contextlib.suppress(OSError):
                Path(d).rmdir()
        nodes = self.state_dir / "nodes"
        if os.path.ismount(nodes) and subprocess.run(["umount", str(nodes)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(nodes)], capture_output=True)
        if nodes.exists() and not os.path.ismount(nodes):
            shutil.rmtree(nodes)
        self.disk_image.unlink(missing_ok=True)
        for name in ("inventory.yml", "known_hosts", "admin_authorized_keys", "state.json"):
            (self.state_dir / name).unlink(missing_ok=True)


def make_ed25519_key(path: Path, comment: str) -> None:
    """A passphrase-less ed25519 key pair at ``path`` and ``path.pub``."""
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])


def kill_namespace(ns: str) -> None:
    """Stop every process in network namespace `ns` (sshd and whatever it started): TERM, then KILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = subprocess.run(["ip", "netns", "pids", ns], text=True, capture_output=True).stdout.split()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), sig)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if not subprocess.run(["ip", "netns", "pids", ns], text=True, capture_output=True).stdout.split():
                return
            time.sleep(0.1)


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def wait_for_port(host: str, port: int, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} at {host}:{port} did not come up: {exc}") from exc
            time.sleep(0.2)


def debian_packages_of_roles() -> list[str]:
    data = yaml.safe_load((REPO / "roles/system_packages/vars/Debian.yml").read_text())
    return list(data["system_packages_os"])


def ensure_base_image() -> None:
    """The nodes' shared OS: the base packages, the roles' OS packages, and the cluster account."""
    wanted = [*BASE_PACKAGES, *debian_packages_of_roles()]
    missing = [
        p
        for p in wanted
        if "install ok installed"
        not in subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], text=True, capture_output=True).stdout
    ]
    if missing:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], check=True, env=env)
    if subprocess.run(["getent", "passwd", CLUSTER_USER], capture_output=True).returncode != 0:
        # Shared /etc/passwd, like an LDAP account on real clusters; "*": key logins only, not locked.
        run(
            [
                "useradd",
                "--home-dir",
                f"/home/{CLUSTER_USER}",
                "--no-create-home",
                "--shell",
                "/bin/bash",
                "--password",
                "*",
                "--user-group",
                CLUSTER_USER,
            ]
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state", default=str(REPO / ".cluster"), help="state directory (default .cluster)")
    parser.add_argument("--prefix", default="xsd", help="name prefix of namespaces and links")
    parser.add_argument("--subnet", type=int, default=0, help="third octet of 10.231.X.0/24")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start N nodes and write <state>/inventory.yml")
    up.add_argument("--nodes", type=int, default=4)
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
