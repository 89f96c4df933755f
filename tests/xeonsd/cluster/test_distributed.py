"""Launcher detection, core placement and CPU feature parsing (pure functions, no processes)."""

from __future__ import annotations

import os

import pytest

from xeonsd.cluster.launch import DistributedError, RankInfo, detect_ranks
from xeonsd.cluster.placement import place_rank
from xeonsd.cluster.slurm_tasks import expand_tasks_per_node
from xeonsd.cpu import parse_cpuinfo


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"PMI_RANK": "5", "PMI_SIZE": "16", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"},
            RankInfo(5, 16, 1, 4, "intel-mpi"),
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "3",
                "OMPI_COMM_WORLD_SIZE": "8",
                "OMPI_COMM_WORLD_LOCAL_RANK": "3",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            },
            RankInfo(3, 8, 3, 4, "open-mpi"),
        ),
        (
            {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
            RankInfo(1, 2, 1, 2, "torchrun"),
        ),
        ({}, RankInfo(0, 1, 0, 1, "single")),
    ],
)
def test_detect_ranks_from_each_launcher(env, expected):
    assert detect_ranks(env) == expected


# What srun gives the tasks of a job step (measured on the Slurm test cluster: srun -N2 -n4 put 3 on node1, 1 on
# node2), and the batch script itself, which is no rank: it has SLURM_PROCID=0 and the job's SLURM_NTASKS too.
SRUN_TASK = {
    "SLURM_JOB_ID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "3,1",
}


def test_slurm_task_ranks_come_from_srun_variables():
    assert detect_ranks(SRUN_TASK) == RankInfo(3, 4, 0, 1, "slurm")
    on_node1 = {**SRUN_TASK, "SLURM_PROCID": "2", "SLURM_LOCALID": "2", "SLURM_NODEID": "0"}
    assert detect_ranks(on_node1) == RankInfo(2, 4, 2, 3, "slurm")
    batch_script = {"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "16"}
    assert detect_ranks(batch_script) == RankInfo(0, 1, 0, 1, "single")


def test_mpi_variables_win_over_slurms():
    """Intel MPI's mpirun inside an allocation: its own ranks, not the srun step's that started its proxies."""
    env = {**SRUN_TASK, "PMI_RANK": "5", "PMI_SIZE": "16", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
    assert detect_ranks(env) == RankInfo(5, 16, 1, 4, "intel-mpi")


def test_slurm_tasks_per_node_expand():
    assert expand_tasks_per_node("4(x3),2") == [4, 4, 4, 2]
    with pytest.raises(ValueError, match="tasks per node 'four'"):
        expand_tasks_per_node("four")
    with pytest.raises(DistributedError, match="SLURM_NODEID=4 is out of range"):
        detect_ranks({**SRUN_TASK, "SLURM_NODEID": "4", "SLURM_STEP_TASKS_PER_NODE": "4(x4)"})
    with pytest.raises(DistributedError, match="rank 4 of 4"):
        detect_ranks({**SRUN_TASK, "SLURM_PROCID": "4"})


def test_out_of_range_rank_is_an_error():
    with pytest.raises(DistributedError, match="rank 4 of 4"):
        detect_ranks({"PMI_RANK": "4", "PMI_SIZE": "4"})
    with pytest.raises(DistributedError, match="not an integer"):
        detect_ranks({"PMI_RANK": "x", "PMI_SIZE": "4"})


def test_user_thread_count_is_respected(monkeypatch):
    before = os.sched_getaffinity(0)
    placement = place_rank(RankInfo(0, 2, 0, 2, "intel-mpi"), {"OMP_NUM_THREADS": "1"})
    assert placement.threads == 1 and placement.source == "user"
    assert os.sched_getaffinity(0) == before


def test_ranks_on_a_node_get_disjoint_cores():
    before = os.sched_getaffinity(0)
    try:
        n = len(before)
        if n < 2:
            pytest.skip("needs at least 2 CPUs")
        seen = []
        for local in range(2):
            os.sched_setaffinity(0, before)
            p = place_rank(RankInfo(local, 2, local, 2, "intel-mpi"), {})
            assert p.source == "auto" and p.threads == len(p.cpus) >= 1
            assert set(os.sched_getaffinity(0)) == set(p.cpus)
            seen.append(set(p.cpus))
        assert not (seen[0] & seen[1])
    finally:
        os.sched_setaffinity(0, before)


def test_cpuinfo_bf16_paths():
    amx = parse_cpuinfo("model name\t: Intel Xeon Platinum 8480+\nflags\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile\n")
    assert amx.native_bf16 == "AMX" and amx.model.startswith("Intel")
    avx = parse_cpuinfo("model name\t: Xeon\nflags\t: avx512f avx512_bf16\n")
    assert avx.native_bf16 == "AVX512-BF16"
    assert parse_cpuinfo("model name\t: AMD EPYC\nflags\t: avx avx2\n").native_bf16 is None


def test_master_port_in_use_gives_the_hint(monkeypatch):
    """Rank 0 hosts the rendezvous on MASTER_PORT; a port another process holds fails at once, saying what to do."""
    import socket

    from xeonsd.cluster.distributed import init_process_group

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        monkeypatch.setenv("XEONSD_DIST_TIMEOUT", "20")
        info = RankInfo(rank=0, world_size=2, local_rank=0, local_world_size=1, launcher="test")
        with pytest.raises(DistributedError) as err:
            init_process_group(info, backend="gloo")
    message = str(err.value)
    assert f"127.0.0.1:{port}" in message
    assert f"Port {port} on 127.0.0.1 is already in use" in message and "set MASTER_PORT to a free port" in message


def test_the_collective_watchdog_fires_only_past_the_limit_in_force():
    """Backend-independent dead-peer detection: a watched collective that waits past the limit is reported once;
    one that finishes in time, or one under a longer scoped limit, is not."""
    import time as _time

    from xeonsd.cluster.distributed import CollectiveTimeout

    fired: list[str] = []
    limit = CollectiveTimeout(world_size=2, initial_s=0.3, on_expiry=fired.append, poll_s=0.05)
    with limit.watch("barrier"):
        _time.sleep(0.1)
    with limit.scope(5.0), limit.watch("all-reduce"):
        _time.sleep(0.5)
    assert fired == [] and limit.current == 0.3
    with limit.watch("all-reduce"):
        _time.sleep(0.6)
    assert fired == [
        "the all-reduce failed: a peer rank died, its node went away or it stalled past the collective "
        "timeout (no answer within 0.3 s)"
    ]
    limit.close()
    single = CollectiveTimeout(world_size=1, initial_s=0.01, on_expiry=fired.append)
    with single.watch("all-reduce"):
        _time.sleep(0.05)
    assert len(fired) == 1


def test_a_lost_peer_error_names_the_peer_gloo_named():
    """The address gloo puts in a failed connection's message goes into the rank's status file (jobstatus)."""
    from xeonsd.cluster.distributed import PeerLostError, collective, peer_address

    assert peer_address("[pair.cc:537] Read error [10.0.0.13]:23753: Connection reset by peer.") == "10.0.0.13"
    assert peer_address("Connection closed by peer [10.0.0.14]:4000") == "10.0.0.14"
    assert peer_address("Timed out waiting 45000ms for recv operation to complete") is None
    with pytest.raises(PeerLostError) as err, collective("all-reduce"):
        raise RuntimeError("Connection closed by peer [10.0.0.12]:51777")
    assert err.value.peer == "10.0.0.12" and "the all-reduce failed: a peer rank died" in str(err.value)
