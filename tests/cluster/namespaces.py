"""Network and mount namespaces, and the nodes' disk.

A node is a network namespace whose eth0 is one end of a veth pair, the other end on a private bridge on the host.
Its processes run in a private mount namespace in which the node's own directories are bind mounts of per-node
directories on one loop-mounted disk image. Every function that removes something is safe to call on something
that was never made or is already gone, so that `down` can clean up after a crash half-way through `up`.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

from host import run


# --- network ------------------------------------------------------------------------------------------------------
def add_bridge(bridge: str, cidr: str) -> None:
    """A bridge with address `cidr` (the controller's side of every node's link), up."""
    run(["ip", "link", "add", bridge, "type", "bridge"])
    run(["ip", "addr", "add", cidr, "dev", bridge])
    run(["ip", "link", "set", bridge, "up"])


def add_namespace(ns: str, *, veth: str, bridge: str, cidr: str) -> None:
    """Network namespace `ns` with eth0 at `cidr`, linked to `bridge` by the veth pair `veth` / eth0, and lo up."""
    run(["ip", "netns", "add", ns])
    run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
    run(["ip", "link", "set", veth, "master", bridge, "up"])
    run(["ip", "-n", ns, "addr", "add", cidr, "dev", "eth0"])
    run(["ip", "-n", ns, "link", "set", "eth0", "up"])
    run(["ip", "-n", ns, "link", "set", "lo", "up"])


def namespaces_named(prefix: str) -> set[str]:
    """The network namespaces whose names start with `prefix` (also those a crashed run did not record)."""
    listed = subprocess.run(["ip", "netns", "list"], text=True, capture_output=True).stdout.split()
    return {n for n in listed if n.startswith(prefix)}


def remove_namespace(ns: str) -> None:
    """Stop every process in `ns`, then delete it (its veth pair goes with it)."""
    kill_namespace(ns)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def remove_link(link: str) -> None:
    subprocess.run(["ip", "link", "del", link], capture_output=True)


# --- processes ----------------------------------------------------------------------------------------------------
def start_in_namespace(ns: str, mounts: list[tuple[Path, str]], argv: list[str], log: Path) -> int:
    """Start `argv` in network namespace `ns`, inside a new private mount namespace where each (source, target)
    of `mounts` is bind-mounted first; its output is appended to `log`. Returns the pid (a new session's leader)."""
    script = " && ".join(f"mount --bind {shlex.quote(str(src))} {shlex.quote(dst)}" for src, dst in mounts)
    script += f" && exec {shlex.join(argv)}"
    with open(log, "ab") as out:
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
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc.pid


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


# --- the nodes' disk ----------------------------------------------------------------------------------------------
def mount_disk(image: Path, mountpoint: Path, size_gb: int) -> None:
    """A fresh sparse ext4 image of `size_gb` GiB (only what is used is stored), loop-mounted at `mountpoint`
    without discard, so wiping a node or the whole cluster is quick (the host filesystem discards every freed
    block one by one)."""
    if mountpoint.exists():
        shutil.rmtree(mountpoint)
    mountpoint.mkdir(parents=True)
    image.unlink(missing_ok=True)
    with open(image, "wb") as f:
        f.truncate(size_gb << 30)
    run(["mkfs.ext4", "-q", "-F", "-E", "nodiscard", "-m", "0", str(image)])
    run(["mount", "-o", "loop,nodiscard", str(image), str(mountpoint)])


def unmount_disk(image: Path, mountpoint: Path) -> None:
    """Unmount (lazily if busy) and remove the image; remove `mountpoint` if nothing is mounted there any more."""
    if os.path.ismount(mountpoint) and subprocess.run(["umount", str(mountpoint)], capture_output=True).returncode:
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)
    if mountpoint.exists() and not os.path.ismount(mountpoint):
        shutil.rmtree(mountpoint)
    image.unlink(missing_ok=True)


def tree_stats(roots: dict[str, Path]) -> dict[str, tuple[int, int]]:
    """Every file and directory under each root, named "<root's name>/<relative path>", with its size and mtime."""
    seen: dict[str, tuple[int, int]] = {}
    for label, root in roots.items():
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                st = Path(dirpath, name).lstat()
                seen[f"{label}/{Path(dirpath, name).relative_to(root)}"] = (st.st_size, st.st_mtime_ns)
    return seen
