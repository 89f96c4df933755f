"""Memory counted the way the kernel shares it (xeonsd.cluster.memory), on real processes, and the rank status
file's memory fields."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from xeonsd.cluster import memory
from xeonsd.cluster.memory import MemoryUnavailable, ProcessMemory, RankMemory, node_totals, read_memory, total
from xeonsd.contracts.job_status import RankStatus, StatusFileError, rank_status_path, read_rank_status
from xeonsd.jobs.status_file import RankStatusFile
from xeonsd.ops.report_cluster import memory_section

MIB = 1 << 20
# A child that maps the file read-only when told to, touches every page (so each is resident in it), and waits.
MAPPER = """
import mmap, sys
sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.readline()
with open(sys.argv[1], "rb") as fh:
    m = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
total = sum(m[i] for i in range(0, len(m), mmap.PAGESIZE))
sys.stdout.write(f"mapped {total}\\n"); sys.stdout.flush()
sys.stdin.readline()
"""


def test_two_processes_mapping_one_file_count_it_once_in_the_pss_sum_and_twice_in_the_rss_sum(tmp_path: Path):
    """Two real processes map the same 64 MiB file read-only. Their RSS sum grows by two copies of it, the sum of
    their PSS (the node total) by one, and each counts it as shared. Tolerance: 10 % of the file (the mapping
    loop's own allocations and the interpreter's pages are of the order of a few hundred kB)."""
    size = 64 * MIB
    data = tmp_path / "weights.bin"
    data.write_bytes(bytes(range(256)) * (size // 256))
    procs = [
        subprocess.Popen([sys.executable, "-c", MAPPER, str(data)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for _ in range(2)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        pids = [p.pid for p in procs]
        before = [read_memory(pid) for pid in pids]
        for p in procs:
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write(b"go\n")
            p.stdin.flush()
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().startswith(b"mapped ")
        after = [read_memory(pid) for pid in pids]
        node = total([read_memory(pid) for pid in pids])
    finally:
        for p in procs:
            p.kill()
            p.wait()
    tolerance = size // 10
    grown = {f: sum(getattr(a, f) - getattr(b, f) for a, b in zip(after, before, strict=True)) for f in memory.FIGURES}
    print(f"64 MiB mapped by 2 processes: growth in MiB { {f: round(v / MIB, 1) for f, v in grown.items()} }")
    assert abs(grown["rss_bytes"] - 2 * size) < tolerance, "the RSS sum counts the shared file once per process"
    assert abs(grown["pss_bytes"] - size) < tolerance, "the PSS sum counts the shared file once"
    for a, b in zip(after, before, strict=True):
        assert abs(a.shared_bytes - b.shared_bytes - size) < tolerance, "each process sees the file as shared"
        assert a.rss_bytes == a.shared_bytes + a.private_bytes
    # the same processes read once more and added up: the same sums, the file counted once in PSS and twice in RSS.
    assert abs(node.pss_bytes - sum(a.pss_bytes for a in after)) < tolerance
    assert node.rss_bytes - node.pss_bytes > size - tolerance


def test_a_missing_smaps_rollup_is_a_clear_error_and_a_rank_runs_on_without_figures(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(memory, "PROC", tmp_path)  # a /proc without the file: not Linux, or a kernel before 4.14
    with pytest.raises(MemoryUnavailable, match=r"smaps_rollup .*Linux 4\.14"):
        read_memory()
    rank = RankMemory(0)
    with caplog.at_level(logging.INFO, logger="xeonsd.train"):
        assert rank.read() is None and rank.read() is None
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "no memory figures for this job" in caplog.records[0].message
    got = []
    assert rank.measure(1, ["node1"], "after loading", lambda *m: got.append(m)) == [] and got == []


def test_a_malformed_smaps_rollup_names_the_field() -> None:
    good = "Rss: 8 kB\nPss: 6 kB\nShared_Clean: 4 kB\nShared_Dirty: 0 kB\nPrivate_Clean: 0 kB\nPrivate_Dirty: 4 kB\n"
    assert memory.parse_smaps_rollup(good) == ProcessMemory(8192, 6144, 4096, 4096)
    with pytest.raises(ValueError, match="no Pss line"):
        memory.parse_smaps_rollup(good.replace("Pss: 6 kB\n", ""))
    with pytest.raises(ValueError, match="'Private_Dirty'.*expected '<number> kB'"):
        memory.parse_smaps_rollup(good.replace("Private_Dirty: 4 kB", "Private_Dirty: x kB"))


def test_node_totals_add_up_each_nodes_ranks_and_skip_a_rank_without_figures() -> None:
    m = [ProcessMemory(10, 6, 8, 2), ProcessMemory(12, 7, 8, 4), None, ProcessMemory(5, 5, 0, 5)]
    rows = node_totals(m, ["a", "a", "b", "b"])
    assert rows == [
        {"node": "a", "ranks": [0, 1], "measured_ranks": 2, **vars(ProcessMemory(22, 13, 16, 6))},
        {"node": "b", "ranks": [2, 3], "measured_ranks": 1, **vars(ProcessMemory(5, 5, 0, 5))},
    ]
    assert "a PSS 0.00 GB over 2 rank(s)" in memory.describe(rows)


def _status(**kw) -> RankStatus:
    return RankStatus(rank=0, world=2, node="n1", address="10.0.0.1", pid=1, state="running", step=3, updated=0.0, **kw)


def test_the_status_file_round_trips_the_memory_fields_and_an_old_file_still_reads(tmp_path: Path) -> None:
    writer = RankStatusFile(tmp_path, _status())
    writer.record_memory(3 * MIB, 2 * MIB, MIB)
    path = rank_status_path(tmp_path, 0)
    got = read_rank_status(path)
    assert (got.pss_bytes, got.shared_bytes, got.private_bytes) == (3 * MIB, 2 * MIB, MIB)
    writer.update(step=4)  # later writes keep the figures until the next ones
    assert read_rank_status(path).pss_bytes == 3 * MIB and read_rank_status(path).step == 4
    # A file written before the fields existed reads, with no figures.
    old = {k: v for k, v in json.loads(path.read_text()).items() if not k.endswith("_bytes")}
    path.write_text(json.dumps(old))
    got = read_rank_status(path)
    assert (got.pss_bytes, got.shared_bytes, got.private_bytes) == (None, None, None) and got.step == 4
    for bad in (-1, "3 GB", 1.5):
        with pytest.raises(StatusFileError, match=f"pss_bytes must be a number of bytes.*{bad!r}"):
            dataclasses.replace(_status(), pss_bytes=bad)


def test_the_report_shows_each_nodes_pss_total_after_loading_and_at_its_highest() -> None:
    def nodes(pss: int) -> dict:
        return {
            "nodes": [
                {
                    "node": "node1",
                    "ranks": [0, 1],
                    "measured_ranks": 2,
                    **vars(ProcessMemory(9_000_000_000, pss, 6_000_000_000, 3_000_000_000)),
                }
            ]
        }

    rows = [
        {"step": 5, "memory_loaded": nodes(4_000_000_000), "memory": nodes(5_000_000_000)},
        {"step": 10, "memory": nodes(5_500_000_000)},
        {"step": 15, "memory": nodes(5_200_000_000)},
    ]
    page = memory_section(rows)
    assert "<h2>Memory per node</h2>" in page
    assert "after loading 4.00 GB (RSS summed 9.00 GB)" in page and "highest 5.50 GB at step 10" in page
    assert "2 rank(s), private 3.00 GB" in page
    assert "mapped from one file" not in page
    with_shared = memory_section(rows, {"unet": 1_720_000_000, "vae": 170_000_000})
    assert (
        "mapped from one file per node" in with_shared and "unet 1.72 GB, vae 0.17 GB; 1.89 GB per node" in with_shared
    )
    assert memory_section([{"step": 5, "loss": 0.1}]) == ""
