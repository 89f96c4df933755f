"""The site's Slurm accounting on the test cluster, for the tests of finetune_launcher=slurm.

The Slurm itself is the slurm role's (provision.yml with tests/cluster/slurm_role_vars.yml: munged, slurmctld and
a slurmd per node, started directly, on the role's default paths, which the test cluster keeps private to each
node). What a site runs beside it, and the role does not install, starts here on the host: MariaDB and slurmdbd
(`SlurmCluster.start_accounting`), so that `sacct` has the jobs' accounting as on a real site. What works in network
namespaces on one machine (checked by hand): cgroup v1, ProctrackType=proctrack/linuxproc,
TaskPlugin=task/none, and the nodes' CPUs and memory taken from slurm.conf (config_overrides: the nodes share the
host's 2 cores).
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

from host import ensure_packages, run

# What the site's accounting needs on the host (the nodes share its /usr; the slurm role's own packages, slurm-wlm
# and munge, are in the nodes' base image: tests/cluster/host.py).
ACCOUNTING_PACKAGES = ("slurmdbd", "mariadb-server")
# Ports on the bridge address: one set per cluster slot (the daemons of two slots never collide).
BASE_PORT = 6817
DB_NAME = "slurm_acct_db"
# Slurm's connection to slurmdbd always uses munge's default socket (AuthInfo=socket= does not reach it): one
# munged for the machine, so one Slurm test cluster at a time.
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")

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


class SlurmSetupError(RuntimeError):
    """A Slurm daemon of the test cluster did not come up; the message names it and its log."""


def short_hostname() -> str:
    return os.uname().nodename.split(".")[0]


class SlurmCluster:
    """The site's accounting daemons of one test cluster; every process it starts is in `pids` (name → pid)."""

    def __init__(self, state: Path, *, address: str, slot: int) -> None:
        self.state = Path(state)
        self.address = address
        self.slot = slot
        self.pids: dict[str, int] = {}

    @property
    def etc(self) -> Path:
        """slurmdbd's configuration directory (slurmdbd.conf; slurmdbd looks beside $SLURM_CONF)."""
        return self.state / "etc"

    @property
    def conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def db_port(self) -> int:
        return BASE_PORT + 10 * self.slot + 3

    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.conf))

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
        ensure_packages(ACCOUNTING_PACKAGES)
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
                host=short_hostname(),
                address=self.address,
                dbd_port=dbd_port,
                user=slurm_user,
                run=run_dir,
                db=DB_NAME,
                db_port=self.db_port,
            )
        )
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


def role_daemon_pids(nodes: list[str], spool: Callable[[str], Path]) -> dict[str, int]:
    """The pids of the daemons the slurm role started on the test cluster (its direct mode, its default paths; the
    nodes share /run, `spool(node)` is the host-side directory of a node's slurmd spool), for `down` to stop. Only
    the pid files whose process runs and is that daemon: a pid file left behind may name a pid reused since."""
    files = {"munged": MUNGE_SOCKET.with_name("munged.pid"), "slurmctld": Path("/run/slurmctld.pid")}
    files.update({f"slurmd-{node}": spool(node) / "slurmd.pid" for node in nodes})
    pids = {}
    for name, f in files.items():
        with contextlib.suppress(OSError, ValueError):
            pid = int(f.read_text())
            if Path(f"/proc/{pid}/comm").read_text().strip() == name.split("-")[0]:
                pids[f"slurm-{name}"] = pid
    return pids


def stopped_munged() -> None:
    """Remove the socket our munged leaves when it is killed (the next cluster's munged starts only without it)."""
    # ... and the lock of the slurm role's munged restart (its handler, direct mode), next to munged's pid file.
    for path in (
        MUNGE_SOCKET,
        MUNGE_SOCKET.with_name(MUNGE_SOCKET.name + ".lock"),
        MUNGE_SOCKET.with_name("munged.pid.restart-lock"),
    ):
        path.unlink(missing_ok=True)
