"""The training job of finetune.yml on the test cluster, for the tests that act while a playbook runs it: the
playbook in the background (stopped however the test ends), the job's progress, and its processes on each node
(their namespaces). Shared by the test_finetune_*.py files, which run in file order on the session's one cluster
(tests/conftest.py); where two checks can share a job start, they do (each start of 16 ranks costs about a minute on
the 2-core test machine)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Cluster
from runner import PlaybookRun, ansible_env, run_playbook

RUNS = "/home/devcloud/runs"


def controller_runs(cluster: Cluster) -> Path:
    """Where the playbooks fetch each run to on the controller (controller_runs_dir), in the cluster's state dir."""
    return cluster.state_dir / "runs"


def finetune_other_base(
    cluster: Cluster, model_id: str, source: Path, run_id: str, steps: int, *extra: str
) -> tuple[PlaybookRun, Path]:
    """Stage ``source`` as base model ``model_id`` (tests/cluster/stage_base_model.yml), then finetune.yml: a LoRA at
    the family's resolution, ``steps`` steps (one checkpoint at the end) on 4 ranks, one per node, and a 4-step
    export; ``extra``: more of finetune.yml's arguments (they win). The play (its rc checked) and the run's directory
    on the controller."""
    runs = controller_runs(cluster)
    base = ("-e", f"base_model_id={model_id}", "-e", f"base_model_source_dir={source}")
    name = model_id.rsplit("/", 1)[-1]
    staged = run_playbook(
        "tests/cluster/stage_base_model.yml",
        cluster.inventory,
        *base,
        state_dir=cluster.state_dir,
        name=f"stage-{name}",
        timeout=600,
    )
    assert staged.rc == 0, staged.tail(60)
    result = run_playbook(
        "finetune.yml",
        cluster.inventory,
        *base,
        *("-e", f"controller_runs_dir={runs}", "-e", f"finetune_run_id={run_id}", "-e", "finetune_method=lora"),
        *("-e", "finetune_resolution=auto", "-e", f"finetune_max_train_steps={steps}"),
        *("-e", f"finetune_checkpointing_steps={steps}"),
        *("-e", "ranks_per_node=1", "-e", "mpi_ranks=4", "-e", "openvino_export_steps=4"),
        *extra,
        state_dir=cluster.state_dir,
        name=f"finetune-{run_id}",
        timeout=1800,
    )
    assert result.rc == 0, result.tail(80)
    return result, runs / run_id


def stage_dataset(cluster: Cluster, name: str, source: Path, *args: str) -> PlaybookRun:
    """tests/cluster/stage_dataset.yml: the image set in the controller's ``source`` on every node, by the dataset role
    alone; ``args``: where it goes (``-e dataset_dir=...``) and what else the role reads. The play, its rc checked."""
    staged = run_playbook(
        "tests/cluster/stage_dataset.yml",
        cluster.inventory,
        *("-e", f"dataset_source_dir={source}", *args),
        state_dir=cluster.state_dir,
        name=name,
        timeout=600,
    )
    assert staged.rc == 0, staged.tail(60)
    return staged


@contextlib.contextmanager
def background_playbook(cluster: Cluster, name: str, *args: str) -> Iterator[tuple[subprocess.Popen, Path, float]]:
    """ansible-playbook in the background (output to a log file), for tests that act while it runs: yields the
    process, its log and when it started. However the block ends (an assertion, a skip, a timeout), the playbook
    is stopped on the way out: its process group, and the training processes it started on the nodes."""
    logs = cluster.state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    argv = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(cluster.inventory), *args]
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            argv,
            cwd=Path(__file__).resolve().parents[2],
            env=ansible_env(cluster.state_dir),
            stdout=fh,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            yield proc, log, time.monotonic()
        finally:
            _stop(cluster, proc)


def _stop(cluster: Cluster, proc: subprocess.Popen) -> None:
    """End what a background playbook started: its process group (SIGTERM, then SIGKILL after 30 s; the group
    outlives an ansible-playbook that already ended only in its leftover children), then any training rank or
    MPI proxy still running in the test cluster's namespaces (the playbook's job; killing ansible does not end
    it)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):  # nothing of it is left
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=30)
            break
        except subprocess.TimeoutExpired:
            continue
    for pid in all_job_processes(cluster):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def finish(proc: subprocess.Popen, timeout: float) -> int:
    """The playbook's exit status once it ends; a failure after ``timeout`` s (_background_playbook stops it)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"ansible-playbook did not end within {timeout} s")


def latest_step(cluster: Cluster) -> int:
    out = cluster.ssh("node1", f"cat {RUNS}/latest/metrics.partial.jsonl 2>/dev/null | tail -1", check=False).stdout
    try:
        return json.loads(out)["step"]
    except (ValueError, KeyError):
        return 0


def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the playbook ended before {what}:\n{log.read_text()[-4000:] if log else ''}")
        time.sleep(1)
    pytest.fail(f"timed out waiting for {what}")


def job_processes(cluster: Cluster, node: str) -> list[int]:
    """PIDs of the training ranks and their MPI proxy in one node's network namespace."""
    pids = subprocess.run(["ip", "netns", "pids", f"{cluster.prefix}-{node}"], capture_output=True, text=True)
    found = []
    for pid in pids.stdout.split():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"xeonsd train" in cmd or b"hydra_pmi_proxy" in cmd or b"hydra_bstrap_proxy" in cmd:
            found.append(int(pid))
    return found


def all_job_processes(cluster: Cluster) -> list[int]:
    return [pid for node in cluster.nodes for pid in job_processes(cluster, node)]


def rank_pids(cluster: Cluster, node: str) -> list[int]:
    """PIDs of the training ranks (not their MPI proxy) in one node's network namespace."""
    ranks = []
    for pid in job_processes(cluster, node):
        with contextlib.suppress(OSError):  # it ended
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            # `python …/xeonsd train …` (or `xeonsd train …`), not a launcher that carries those words as its
            # arguments (mpiexec.hydra on the primary).
            if any(a.endswith(b"xeonsd") and argv[i + 1 : i + 2] == [b"train"] for i, a in enumerate(argv[:2])):
                ranks.append(pid)
    return ranks
