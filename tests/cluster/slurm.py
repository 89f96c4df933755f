"""Slurm on the test cluster: the site's scheduler, for the tests of finetune_launcher=slurm.

Started on a running cluster (`Cluster.start_slurm`), so the other tests pay nothing: on the host one munged (its
own key and socket under the state directory), MariaDB and slurmdbd (so that `sacct` has the jobs' accounting, as
on a real site) and slurmctld; in each node's namespace one `slurmd -D -N nodeX`, started like its sshd: in its own
mount namespace with the node's private directories, its own /var/spool/slurmd and the cluster's /etc/slurm bind
-mounted. The same /etc/slurm is bind-mounted into the mount namespace of each node's sshd (nsenter), so `sbatch`,
`srun` and `sacct` over SSH find the cluster's slurm.conf where a site puts it. What works in network namespaces on
one machine (checked by hand, issue 21): cgroup v1, ProctrackType=proctrack/linuxproc, TaskPlugin=task/none,
and the nodes' CPUs and memory taken from slurm.conf (config_overrides: the nodes share the host's 2 cores).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from host import run
from namespaces import start_in_namespace

# What Slurm on the test cluster needs on the host (the nodes share its /usr).
SLURM_PACKAGES = ("slurm-wlm", "slurmdbd", "munge", "mariadb-server")
PARTITION = "xeonsd"
# Ports on the bridge address: one set per cluster slot (the daemons of two slots never collide).
BASE_PORT = 6817
DB_NAME = "slurm_acct_db"
# Slurm's connection to slurmdbd always uses munge's default socket (AuthInfo=socket= does not reach it): one
# munged for the machine, so one Slurm test cluster at a time.
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")

SLURM_CONF = """\
# slurm.conf of the test cluster (tests/cluster/slurm.py)
ClusterName={cluster}
SlurmctldHost={host}({address})
SlurmctldPort={ctld_port}
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={state}/ctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmdPidFile=/var/spool/slurmd/slurmd.pid
SlurmctldPidFile={state}/slurmctld.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile=/var/spool/slurmd/slurmd.log
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SchedulerType=sched/backfill
InactiveLimit=0
KillWait=10
MinJobAge=600
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost={address}
AccountingStoragePort={dbd_port}
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=5
JobCompType=jobcomp/none
{nodes}
PartitionName={partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""

SLURMDBD_CONF = """\
# slurmdbd.conf of the test cluster (tests/cluster/slurm.py)
AuthType=auth/munge
DbdHost={host}
DbdAddr={address}
DbdPort={dbd_port}
SlurmUser={user}
PidFile={run}/slurmdbd.pid
LogFile={run}/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StorageLoc={db}
StoragePort={db_port}
StorageUser=slurm
StoragePass=xeonsd-test
"""

CGROUP_CONF = "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n"


class SlurmSetupError(RuntimeError):
    """A Slurm daemon of the test cluster did not come up; the message names it and its log."""


def node_line(node: str, address: str, cpus: int, memory_mb: int) -> str:
    return f"NodeName={node} NodeAddr={address} CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN"


def render_slurm_conf(*, cluster: str, state: Path, address: str, slot: int, nodes: dict[str, str], cpus: int) -> str:
    """slurm.conf for `nodes` (name → address), each with `cpus` CPUs, the daemons on the host at `address`."""
    return SLURM_CONF.format(
        cluster=cluster,
        host=short_hostname(),
        address=address,
        ctld_port=BASE_PORT + 10 * slot,
        dbd_port=BASE_PORT + 10 * slot + 2,
        state=state,
        nodes="\n".join(node_line(n, a, cpus, 1024) for n, a in nodes.items()),
        partition=PARTITION,
    )


def short_hostname() -> str:
    return os.uname().nodename.split(".")[0]


class SlurmCluster:
    """The Slurm daemons of one test cluster; `start` records every process it starts in `pids` (name → pid)."""

    def __init__(self, state: Path, *, cluster: str, address: str, slot: int) -> None:
        self.state = Path(state)
        self.cluster = cluster
        self.address = address
        self.slot = slot
        self.pids: dict[str, int] = {}

    @property
    def etc(self) -> Path:
        """The cluster's /etc/slurm (slurm.conf, cgroup.conf): bind-mounted on every node."""
        return self.state / "etc"

    @property
    def conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def db_port(self) -> int:
        return BASE_PORT + 10 * self.slot + 3

    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def spool(self, node: str) -> Path:
        return self.state / "spool" / node

    def write_config(self, nodes: dict[str, str], cpus: int) -> None:
        if self.state.exists():
            shutil.rmtree(self.state)
        for d in (self.etc, self.state / "ctld", self.state / "munge", self.state / "munge-key", self.state / "db"):
            d.mkdir(parents=True)
        os.chmod(self.state / "munge-key", 0o700)
        key = self.state / "munge-key" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.conf.write_text(
            render_slurm_conf(
                cluster=self.cluster, state=self.state, address=self.address, slot=self.slot, nodes=nodes, cpus=cpus
            )
        )
        (self.etc / "cgroup.conf").write_text(CGROUP_CONF)
        dbd = self.etc / "slurmdbd.conf"
        dbd.write_text(
            SLURMDBD_CONF.format(
                host=short_hostname(),
                address=self.address,
                dbd_port=BASE_PORT + 10 * self.slot + 2,
                user="root",
                run=self.state,
                db=DB_NAME,
                db_port=self.db_port,
            )
        )
        os.chmod(dbd, 0o600)  # slurmdbd refuses a readable config (it may hold the database password)
        for node in nodes:
            self.spool(node).mkdir(parents=True)

    def _daemon(self, name: str, argv: list[str]) -> None:
        log = self.state / f"{name}.out"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env(),
            )
        self.pids[name] = proc.pid

    def start_accounting(self, slurm_user: str) -> list[str]:
        """The site's accounting for a Slurm that the slurm role built: MariaDB and slurmdbd on the host, slurmdbd
        as `slurm_user` (the role's SlurmUser: slurmdbd takes the controller's registration from that account).
        munged is the role's (munge's default socket: the nodes share /run), asked once a daemon connects.
        Returns the lines that point the role's slurm.conf at it (slurm_conf_extra_lines)."""
        if self.state.exists():
            shutil.rmtree(self.state)
        run_dir = self.state / "dbd"  # slurmdbd's pid file and log, written as slurm_user
        for d in (self.etc, self.state / "db", run_dir):
            d.mkdir(parents=True)
        account = pwd.getpwnam(slurm_user)
        os.chown(run_dir, account.pw_uid, account.pw_gid)
        dbd_port = BASE_PORT + 10 * self.slot + 2
        dbd = self.etc / "slurmdbd.conf"
        dbd.write_text(
            SLURMDBD_CONF.format(
                host=short_hostname(), address=self.address, dbd_port=dbd_port, user=slurm_user, run=run_dir,
                db=DB_NAME, db_port=self.db_port,
            )
        )  # fmt: skip
        os.chown(dbd, account.pw_uid, account.pw_gid)
        os.chmod(dbd, 0o600)  # slurmdbd refuses a config that others can read (it holds the database password)
        self._start_database()
        self._daemon("slurmdbd", ["/usr/sbin/slurmdbd", "-D"])
        self._wait(lambda: _port_open(self.address, dbd_port), "slurmdbd", "dbd/slurmdbd.log")
        return [
            "AccountingStorageType=accounting_storage/slurmdbd",
            f"AccountingStorageHost={self.address}",
            f"AccountingStoragePort={dbd_port}",
        ]

    def start_host_daemons(self) -> None:
        """munged, MariaDB, slurmdbd and slurmctld on the host, each waited for."""
        m = self.state / "munge"
        if MUNGE_SOCKET.exists():
            raise SlurmSetupError(
                f"{MUNGE_SOCKET} exists: another munged runs on this machine (another Slurm test cluster?); "
                "stop it first (munged --stop)"
            )
        MUNGE_SOCKET.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        self._daemon(
            "munged",
            [
                "/usr/sbin/munged",
                "--foreground",
                "--force",
                f"--socket={MUNGE_SOCKET}",
                f"--key-file={self.state / 'munge-key' / 'munge.key'}",
                f"--pid-file={m / 'munged.pid'}",
                f"--seed-file={m / 'munged.seed'}",
                f"--log-file={m / 'munged.log'}",
            ],
        )
        self._wait(lambda: MUNGE_SOCKET.exists(), "munged", m / "munged.log")
        self._start_database()
        self._daemon("slurmdbd", ["/usr/sbin/slurmdbd", "-D"])
        self._wait(lambda: _port_open(self.address, BASE_PORT + 10 * self.slot + 2), "slurmdbd", "slurmdbd.log")
        self._daemon("slurmctld", ["/usr/sbin/slurmctld", "-D", "-i"])
        self._wait(lambda: _port_open(self.address, BASE_PORT + 10 * self.slot), "slurmctld", "slurmctld.log")

    def _start_database(self) -> None:
        db = self.state / "db"
        run(
            [
                "mariadb-install-db",
                "--user=root",
                f"--datadir={db / 'data'}",
                "--auth-root-authentication-method=normal",
            ]
        )
        sock = db / "mysqld.sock"
        self._daemon(
            "mariadbd",
            [
                "/usr/sbin/mariadbd",
                "--no-defaults",
                "--user=root",
                f"--datadir={db / 'data'}",
                f"--socket={sock}",
                f"--pid-file={db / 'mariadbd.pid'}",
                "--bind-address=127.0.0.1",
                f"--port={self.db_port}",
                "--skip-name-resolve",
                "--innodb-buffer-pool-size=32M",
                f"--log-error={db / 'mariadbd.log'}",
            ],
        )
        self._wait(lambda: _port_open("127.0.0.1", self.db_port), "mariadbd", db / "mariadbd.log")
        sql = (
            "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'xeonsd-test';"
            f"GRANT ALL ON {DB_NAME}.* TO 'slurm'@'127.0.0.1';"
        )
        run(["mariadb", f"--socket={sock}", "-u", "root", "-e", sql])

    def start_slurmd(self, ns: str, node: str, mounts: list[tuple[Path, str]]) -> None:
        """slurmd of `node` in namespace `ns`, with the node's private directories (`mounts`), its spool and the
        cluster's /etc/slurm mounted in its own mount namespace (the jobs' processes inherit them)."""
        all_mounts = [*mounts, (self.spool(node), "/var/spool/slurmd"), (self.etc, "/etc/slurm")]
        self.pids[f"slurmd-{node}"] = start_in_namespace(
            ns, all_mounts, ["/usr/sbin/slurmd", "-D", "-N", node], self.state / f"slurmd-{node}.out"
        )

    def wait_for_nodes(self, nodes: list[str], timeout: float = 60) -> None:
        """Until every node is idle in the partition; else SlurmSetupError with what sinfo says."""
        deadline = time.monotonic() + timeout
        while True:
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-p", PARTITION, "-o", "%N %t"], text=True, capture_output=True, env=self.env()
            ).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if all(states.get(n) == "idle" for n in nodes):
                return
            if time.monotonic() > deadline:
                raise SlurmSetupError(
                    f"Slurm nodes not idle within {timeout:g} s: {states or out!r} "
                    f"(logs: {self.state}/slurmctld.log, {self.state}/spool/<node>/slurmd.log)"
                )
            time.sleep(1)

    def _wait(self, ready, name: str, log: Path | str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            pid = self.pids[name]
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    raise SlurmSetupError(f"{name} exited at start-up; its output: {self.state / (name + '.out')}")
            if time.monotonic() > deadline:
                raise SlurmSetupError(f"{name} did not come up within {timeout:g} s; its log: {self.state / log}")
            time.sleep(0.3)


def _port_open(host: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def bind_into(pid: int, source: Path, target: str) -> None:
    """Bind-mount `source` at `target` in the mount namespace of process `pid` (a node's sshd: its SSH sessions,
    and so the jobs' sbatch and sacct, see the cluster's /etc/slurm)."""
    run(["nsenter", "--target", str(pid), "--mount", "--", "mount", "--bind", str(source), target])


def role_daemon_pids(nodes: list[str], spool: Callable[[str], Path]) -> dict[str, int]:
    """The pids of the daemons the slurm role started on the test cluster (its direct mode, its default paths; the
    nodes share /run, `spool(node)` is the host-side directory of a node's slurmd spool), as `down` records them."""
    files = {"munged": MUNGE_SOCKET.with_name("munged.pid"), "slurmctld": Path("/run/slurmctld.pid")}
    files.update({f"slurmd-{node}": spool(node) / "slurmd.pid" for node in nodes})
    return {f"slurm-{name}": int(f.read_text()) for name, f in files.items() if f.exists()}


def stopped_munged() -> None:
    """Remove the socket our munged leaves when it is killed (the next cluster's munged starts only without it)."""
    # ... and the lock of the slurm role's munged restart (its handler, direct mode), next to munged's pid file.
    for path in (
        MUNGE_SOCKET,
        MUNGE_SOCKET.with_name(MUNGE_SOCKET.name + ".lock"),
        MUNGE_SOCKET.with_name("munged.pid.restart-lock"),
    ):
        path.unlink(missing_ok=True)
