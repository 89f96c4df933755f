"""Each node's sshd (its own /etc/ssh, host key and config), and SSH from the controller to the nodes."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from host import run
from namespaces import start_in_namespace

SSHD_CONFIG = """\
# sshd of test node {node} (tests/cluster/sshd.py)
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


def make_ed25519_key(path: Path, comment: str) -> None:
    """A passphrase-less ed25519 key pair at ``path`` and ``path.pub``."""
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])


# The admin's (Ansible's) home and the SSH configuration: private to each node too, beside the inventory's node
# directories. A node's root home is a fresh server's, not this machine's: its shell starts clean (here root's
# ~/.bashrc runs `pyenv init`, 0.1 CPU s on every SSH command, that is on every module run of every playbook), and
# Ansible's remote temporary files stay on the node.
ADMIN_HOME = "/root"
NODE_SYSTEM_DIRS = ("/etc/ssh", ADMIN_HOME)
SKELETON = Path("/etc/skel")


def prepare_admin_home(home: Path) -> None:
    """The node's root home (made at `home` on the host): the distribution's skeleton dotfiles, as on a new server."""
    home.mkdir(parents=True)
    os.chmod(home, 0o700)
    for name in (".bashrc", ".profile"):
        if (SKELETON / name).is_file():
            shutil.copy2(SKELETON / name, home / name)


def prepare_etc_ssh(etc_ssh: Path, *, node: str, address: str, admin_authorized_keys: Path) -> str:
    """The node's own /etc/ssh (made at `etc_ssh` on the host): the host's client configuration, a host key of
    its own, the controller's key and an sshd_config listening on `address`. Returns the public host key."""
    etc_ssh.mkdir(parents=True)
    for name in ("ssh_config", "moduli"):
        if Path("/etc/ssh", name).exists():
            shutil.copy2(Path("/etc/ssh", name), etc_ssh / name)
    if Path("/etc/ssh/ssh_config.d").is_dir():
        shutil.copytree("/etc/ssh/ssh_config.d", etc_ssh / "ssh_config.d")
    make_ed25519_key(etc_ssh / "ssh_host_ed25519_key", f"root@{node}")
    # The controller's key, inside the node's own /etc/ssh: sshd's StrictModes refuses a key file anywhere
    # below a group- or world-writable directory, such as a checkout under /tmp.
    shutil.copy2(admin_authorized_keys, etc_ssh / "admin_authorized_keys")
    os.chmod(etc_ssh, 0o755)
    (etc_ssh / "sshd_config").write_text(SSHD_CONFIG.format(node=node, address=address))
    return (etc_ssh / "ssh_host_ed25519_key.pub").read_text()


def start_sshd(ns: str, mounts: list[tuple[Path, str]], log: Path) -> int:
    """sshd in the foreground in namespace `ns`, after the node's private directories (`mounts`, /etc/ssh among
    them) are bind-mounted in its own mount namespace. Returns its process group's pid."""
    return start_in_namespace(ns, mounts, ["/usr/sbin/sshd", "-D", "-e", "-f", "/etc/ssh/sshd_config"], log)


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


def ssh_argv(*, key: Path, known_hosts: Path, destination: str, command: str) -> list[str]:
    """The controller's ssh command line to a node: its own key only, host keys checked, never a prompt."""
    return [
        "ssh",
        "-i",
        str(key),
        "-o",
        f"UserKnownHostsFile={known_hosts}",
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=yes",
        destination,
        command,
    ]


def close_control_masters(control_path_dir: Path) -> None:
    """Close the SSH control masters whose sockets are in `control_path_dir` (Ansible's shared connections)."""
    if not control_path_dir.is_dir():
        return
    for sock in control_path_dir.glob("*"):
        subprocess.run(["ssh", "-O", "exit", "-o", f"ControlPath={sock}", "node"], capture_output=True, timeout=10)
