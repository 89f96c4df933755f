"""`xeonsd hello` under real mpirun: the ranks form the trainer's process group, or it says why not."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from xeonsd.cluster.distributed import node_address
from xeonsd.cluster.hello import Member, gloo_loopback_hint, interface_of, node_lines


def _mpirun(env: dict[str, str]) -> str:
    mpirun = shutil.which("mpirun", path=env["PATH"])
    assert mpirun, "mpirun (impi-rt) is not installed in the environment"
    return mpirun


def _mpi_env(env: dict[str, str]) -> dict[str, str]:
    env = dict(env)
    env.setdefault("I_MPI_FABRICS", "shm")
    env["MASTER_ADDR"] = "127.0.0.1"
    env["MASTER_PORT"] = str(29400 + os.getpid() % 100)
    return env


HELLO = [sys.executable, "-m", "xeonsd.cli", "hello"]


def test_two_ranks_all_reduce_and_report_their_node(cli_env):
    env = _mpi_env(cli_env)
    cmd = [_mpirun(env), "-n", "2", *HELLO, "--expect-ranks", "2", "--expect-nodes", "1"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    # Rank 0 alone prints: one line for the node (by the address that routes to MASTER_ADDR), then the summary.
    assert lines[-1] == "hello: 2 ranks on 1 node, backend gloo, all-reduce ok (sum=3)", proc.stdout
    assert len(lines) == 2 and lines[0].startswith("127.0.0.1: ranks 0 1 (host "), proc.stdout


def test_a_world_other_than_the_expected_one_fails(cli_env):
    env = _mpi_env(cli_env)
    cmd = [_mpirun(env), "-n", "2", *HELLO, "--expect-ranks", "3", "--expect-nodes", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "hello: 2 ranks on 1 node, backend gloo, all-reduce ok" in proc.stdout
    assert "xeonsd hello: error: the job has 2 ranks, expected 3" in proc.stderr
    assert "xeonsd hello: error: the ranks run on 1 node, expected 2" in proc.stderr


def test_ranks_that_cannot_meet_fail_with_the_rendezvous_named(cli_env):
    """Rank 1 looks for rank 0 on another port (a wrong MASTER_PORT on one node): the group never forms; the
    first rank to give up (after --timeout) says where it tried to meet and has mpirun end the other one."""
    env = _mpi_env(cli_env)
    port = int(env["MASTER_PORT"])
    cmd = [
        _mpirun(env),
        "-n",
        "1",
        "-env",
        "MASTER_PORT",
        str(port),
        *HELLO,
        "--timeout",
        "5",
        ":",
        "-n",
        "1",
        "-env",
        "MASTER_PORT",
        str(port + 1),
        *HELLO,
        "--timeout",
        "5",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "hello:" not in proc.stdout
    errors = re.findall(
        r"xeonsd hello: error: rank (\d): could not join the gloo process group at 127.0.0.1:(\d+)", proc.stderr
    )
    assert errors, proc.stderr[-3000:]
    assert all(int(p) == port + int(rank) for rank, p in errors), errors


def test_a_single_process_is_not_a_job(cli_env):
    proc = subprocess.run([*HELLO, "--expect-ranks", "2"], env=cli_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "started as a single process" in proc.stderr and "run it under mpirun" in proc.stderr


def test_node_address_is_the_local_end_of_the_route():
    assert node_address("127.0.0.1") == "127.0.0.1"
    # Any routable destination: the answer is one of this machine's own addresses (a UDP connect sends nothing).
    addr = node_address("10.231.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((addr, 0))
        except OSError as exc:
            pytest.fail(f"{addr} is not an address of this machine: {exc}")


def test_node_lines_group_ranks_by_address_in_rank_order():
    members = [
        Member(2, 0, "10.0.0.2", "b", 12),
        Member(0, 0, "10.0.0.1", "a", 10),
        Member(3, 1, "10.0.0.2", "b", 13),
        Member(1, 1, "10.0.0.1", "a", 11),
    ]
    assert node_lines(members) == [
        "10.0.0.1: ranks 0 1 (host a, pids 10,11)",
        "10.0.0.2: ranks 2 3 (host b, pids 12,13)",
    ]


def test_a_hostname_on_loopback_is_named_as_the_reason_gloo_cannot_cross_nodes(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(socket, "gethostname", lambda: "node7")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1" if name == "node7" else "0.0.0.0")
    hint = gloo_loopback_hint("10.231.9.17")
    assert hint is not None
    assert "gloo listens on 127.0.1.1" in hint and "'node7' resolves to loopback" in hint
    assert "export GLOO_SOCKET_IFNAME=" in hint
    # Not the reason: a single node (the route is loopback), an interface already chosen, a hostname that
    # resolves to a real address.
    assert gloo_loopback_hint("127.0.0.1") is None
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    assert gloo_loopback_hint("10.231.9.17") is None
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "10.231.9.17")
    assert gloo_loopback_hint("10.231.9.17") is None


def test_interface_of_finds_the_interface_holding_an_address():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.123") is None  # TEST-NET-1: on no interface here
