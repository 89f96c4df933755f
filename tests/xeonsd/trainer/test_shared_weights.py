"""Frozen weights shared by a node's ranks (trainer.shared_weights): one file per component, mapped read-only by
every rank, its pages held once; a write to it fails loudly; jobs share a file, rebuild a bad one, and the last one
removes it; and training on it learns bit for bit what private copies learn."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from cli_runs import method_args, refused, train
from safetensors.torch import load_file, save_file

from xeonsd.cluster.memory import read_memory
from xeonsd.trainer.shared_weights import Component, SharedWeightsError, open_store

MIB = 1 << 20
SHAPE = (4096, 2048)  # 8 Mi elements: 16 MiB in bf16


def _empty() -> torch.nn.Module:
    with torch.device("meta"):
        return torch.nn.Linear(SHAPE[1], SHAPE[0])


def _source(tmp_path: Path) -> Path:
    path = tmp_path / "lin.safetensors"
    if not path.exists():
        g = torch.Generator().manual_seed(0)
        save_file({"weight": torch.randn(SHAPE, generator=g), "bias": torch.randn(SHAPE[0], generator=g)}, str(path))
    return path


def _component(src: Path, dtype: torch.dtype = torch.bfloat16) -> Component:
    return Component("lin", _empty, [src], dtype, lambda: pytest.fail("the names fit: no whole load"), "fp-1")


CHILD = textwrap.dedent(
    """
    import json, logging, os, sys
    from pathlib import Path
    import torch
    from xeonsd.trainer.shared_weights import Component, open_store
    def _empty():
        with torch.device("meta"):
            return torch.nn.Linear(2048, 4096)
    def _component(src):
        return Component("lin", _empty, [src], torch.bfloat16, None, "fp-1")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    root, src, action = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    with open_store(root, "base", "fp-1", keep=False) as store:
        model = store.load(_component(src))
        total = float(model.weight.float().sum())  # every page read
        if action == "write":
            with torch.no_grad():
                model.weight.add_(1.0)  # a frozen weight written in place
        ino = os.stat(store.directory / "lin.weights").st_ino
        print(json.dumps({"ino": ino, "sum": total, "ptr": model.weight.data_ptr()}), flush=True)
        sys.stdin.readline()  # hold the mapping while the test measures
    """
)


def _start(tmp_path: Path, action: str = "read") -> subprocess.Popen:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    args = [sys.executable, "-X", "faulthandler", str(script), str(tmp_path / "shm"), str(_source(tmp_path)), action]
    # one thread: when several threads of an in-place op fault at once, faulthandler's dump can be cut short (the
    # process still dies by SIGSEGV)
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if action == "write" else None
    return subprocess.Popen(
        args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env,
    )  # fmt: skip


def _mapping(pid: int, name: str) -> dict[str, int]:
    """Rss and Pss (bytes) of the process's mappings of the file ``name`` (from /proc/PID/smaps), and the address
    range they span."""
    out, inside = {"Rss": 0, "Pss": 0, "start": 1 << 64, "end": 0}, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            inside = line.rstrip().endswith(name)
            if inside:
                start, end = (int(x, 16) for x in head[0].split("-"))
                out["start"], out["end"] = min(out["start"], start), max(out["end"], end)
        elif inside and head[0].rstrip(":") in ("Rss", "Pss"):
            out[head[0].rstrip(":")] += int(head[1]) * 1024
    return out


def test_ranks_of_a_node_map_the_same_pages_built_once(tmp_path):
    """Two processes map the component: each has all 16 MiB resident, but PSS charges each half, the node's total
    counts the bytes once, the file is built by one of them, and the last to leave removes the directory."""
    procs = [_start(tmp_path), _start(tmp_path)]
    try:
        lines = [p.stdout.readline() for p in procs]
        assert all(lines), [p.stderr.read() for p in procs]
        seen = [json.loads(line) for line in lines]
        assert seen[0]["ino"] == seen[1]["ino"] and seen[0]["sum"] == seen[1]["sum"]
        maps = [_mapping(p.pid, "lin.weights") for p in procs]
        weight_bytes = SHAPE[0] * SHAPE[1] * 2
        for m, s in zip(maps, seen, strict=True):
            assert m["start"] <= s["ptr"] < m["end"], "the weight is the mapped file's bytes, not a copy of them"
            assert m["Rss"] >= weight_bytes, maps
            assert abs(m["Pss"] - m["Rss"] / 2) <= MIB, maps
        assert abs(sum(m["Pss"] for m in maps) - maps[0]["Rss"]) <= MIB  # counted once for the node
        assert all(read_memory(p.pid).shared_bytes >= weight_bytes for p in procs)
    finally:
        for p in procs:
            p.communicate("\n", timeout=60)
    assert all(p.returncode == 0 for p in procs)
    assert not list((tmp_path / "shm").glob("base-*")), "the last job out removes the shared weights"


def test_a_rank_that_writes_a_frozen_weight_dies_loudly_and_the_file_is_unchanged(tmp_path):
    proc = _start(tmp_path, "write")
    out, err = proc.communicate("\n", timeout=120)
    assert proc.returncode == -11, (proc.returncode, out, err[-2000:])  # SIGSEGV, not a silent private copy
    line = next(i for i, text in enumerate(CHILD.splitlines(), 1) if "add_(1.0)" in text)
    assert "Segmentation fault" in err and f'child.py", line {line}' in err, err[-2000:]
    (directory,) = (tmp_path / "shm").glob("base-*")
    with open_store(tmp_path / "shm", "base", "fp-1", keep=False) as store:  # the crashed rank's file is reused
        model = store.load(_component(_source(tmp_path)))
        source = load_file(str(_source(tmp_path)))
        assert torch.equal(model.weight, source["weight"].to(torch.bfloat16))
    assert not directory.exists()


def test_two_jobs_on_one_base_share_one_file_and_the_last_removes_it(tmp_path, caplog):
    src, root = _source(tmp_path), tmp_path / "shm"
    caplog.set_level(logging.INFO, "xeonsd.train")
    with open_store(root, "base", "fp-1", keep=False) as a:
        wa = a.load(_component(src)).weight
        with open_store(root, "base", "fp-1", keep=False) as b:
            wb = b.load(_component(src)).weight
            assert a.directory == b.directory and wa.data_ptr() != wb.data_ptr() and torch.equal(wa, wb)
        assert a.directory.is_dir(), "removed while another job still maps it"
    assert sum("built" in r.getMessage() for r in caplog.records) == 1
    assert not a.directory.exists()
    with open_store(root, "base", "fp-1", keep=True) as kept:
        kept.load(_component(src))
    assert (kept.directory / "lin.weights").is_file(), "--keep_shared_weights keeps them for the next job"


def test_a_truncated_or_stale_file_is_rebuilt(tmp_path, caplog):
    src, root = _source(tmp_path), tmp_path / "shm"
    expect = load_file(str(src))["weight"]
    with open_store(root, "base", "fp-1", keep=True) as store:
        store.load(_component(src))
    path = store.directory / "lin.weights"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 4096)
    caplog.set_level(logging.INFO, "xeonsd.train")
    with open_store(root, "base", "fp-1", keep=True) as store:
        assert torch.equal(store.load(_component(src)).weight, expect.to(torch.bfloat16))
    assert "incomplete or stale shared weights" in caplog.text
    caplog.clear()
    with open_store(root, "base", "fp-1", keep=False) as store:  # another dtype: the key differs
        weight = store.load(_component(src, torch.float32)).weight
        assert weight.dtype == torch.float32 and torch.equal(weight, expect)
    assert "incomplete or stale shared weights" in caplog.text
    assert not list(root.glob("base-*/.*.tmp-*"))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (root)")
def test_a_directory_without_room_is_refused_naming_it_and_nothing_is_left(tmp_path):
    root = tmp_path / "small"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(root)], check=True)
    try:
        with (
            pytest.raises(SharedWeightsError, match=r"need 0\.02 GB in .*small.* Fix: --shared_weights_dir"),
            open_store(root, "base", "fp-1", keep=False) as store,
        ):
            store.load(_component(_source(tmp_path)))
        assert not [p for p in root.rglob("*") if p.name.endswith(".weights") or ".tmp-" in p.name]
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


def test_two_ranks_on_shared_weights_learn_bit_for_bit_what_private_copies_learn(tiny_model, tmp_path, cli_env):
    """LoRA, 2 ranks under mpirun, same seed: the adapters with --share_weights on equal those with off exactly
    (the mapped tensors hold the same bf16 values, in the same layout, as the private ones)."""
    from xeonsd.assets import make_dataset

    data = tmp_path / "data"
    make_dataset(data, count=4, size=64, captions="metadata")
    shm = tmp_path / "shm"
    out = {}
    for mode in ("on", "off"):
        out[mode] = tmp_path / mode
        args = method_args(
            "lora", tiny_model, data, out[mode], f"--share_weights={mode}", f"--shared_weights_dir={shm}"
        )
        proc = train(args, cli_env, ranks=2)
        assert ("frozen weights mapped from" in proc.stderr) == (mode == "on"), proc.stderr[-3000:]
    a = load_file(str(out["on"] / "pytorch_lora_weights.safetensors"))
    b = load_file(str(out["off"] / "pytorch_lora_weights.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not list(shm.glob("*/*.weights")), "the job's last rank removed the node's shared weights"


def test_ipex_on_with_shared_weights_is_refused(tiny_model, dataset, tmp_path, cli_env):
    args = method_args("lora", tiny_model, dataset, tmp_path / "o", "--use_ipex=on", "--share_weights=on")
    assert "--use_ipex on rewrites (prepacks)" in refused(args, cli_env)


def test_the_last_rank_to_drop_a_component_removes_its_file_during_the_job(tmp_path):
    """T5 after the prompts are encoded: once every rank of the node has released it, its file goes (a tmpfs gives
    the memory back), while the job's other files stay until the job ends."""
    src, root = _source(tmp_path), tmp_path / "shm"
    with open_store(root, "base", "fp-1", keep=False) as rank0, open_store(root, "base", "fp-1", keep=False) as rank1:
        path = rank0.directory / "lin.weights"
        models = [rank0.load(_component(src)), rank1.load(_component(src))]
        del models
        rank0.release("lin")
        assert path.is_file(), "removed while rank 1 still maps it"
        rank1.release("lin")
        assert not path.exists() and rank0.directory.is_dir()
        again = rank0.load(_component(src))  # a later load builds it again
        assert torch.equal(again.weight, load_file(str(src))["weight"].to(torch.bfloat16))
    assert not rank0.directory.exists()


def test_two_ranks_that_release_a_component_at_once_remove_its_file_once(tmp_path, caplog):
    """Both ranks have let go of their users lock before either takes the file's lock (what 8 ranks freeing the VAE
    after one collective do): the first removes the file, the second finds it gone and goes on."""
    src, root = _source(tmp_path), tmp_path / "shm"
    with open_store(root, "base", "fp-1", keep=False) as rank0, open_store(root, "base", "fp-1", keep=False) as rank1:
        path = rank0.directory / "lin.weights"
        models = [rank0.load(_component(src)), rank1.load(_component(src))]
        del models
        # rank 1 has closed its users file (the first thing release does) but not yet taken the lock: a file
        # descriptor that holds no lock stands in for the one it closed.
        os.close(rank1._readers["lin"])
        rank1._readers["lin"] = os.open(os.devnull, os.O_RDONLY)
        with caplog.at_level(logging.INFO, logger="xeonsd.train"):
            rank0.release("lin")
            assert not path.exists()
            rank1.release("lin")  # before the fix: FileNotFoundError, and the rank's job failed
        assert sum("removed " in r.getMessage() and "lin.weights" in r.getMessage() for r in caplog.records) == 1
    assert not rank0.directory.exists()


def test_a_directory_this_account_cannot_write_is_refused_with_the_fix(tmp_path):
    from xeonsd.trainer.shared_weights import shared_root

    assert shared_root("/dev/shm/xeonsd-weights-{uid}") == f"/dev/shm/xeonsd-weights-{os.getuid()}"
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.raises(SharedWeightsError, match=r"cannot use the shared weights directory .*file.* Fix: "):  # noqa: SIM117
        with open_store(blocked / "sub", "base", "fp-1", keep=False):
            pass
