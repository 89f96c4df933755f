"""A finetune.yml job that is stopped, or loses a node, on the real 4-node test cluster, and resume=latest: one run,
three attempts. A SIGTERM to the launcher stops the 8 ranks at one step with a checkpoint there; resumed, a killed
worker node fails the play quickly and by name; resumed again, the run finishes. It trains on 1,000 images (the
dataset role stages them) with aspect-ratio buckets and the latent cache kept on each node's disk. Two ranks per node:
what it proves is about nodes, signals and the cache's shards, not the rank count (the 16-rank job is
test_finetune_e2e.py's), and on 2 cores eight ranks reach their first step in about a quarter of sixteen's time."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from assets import MANY_IMAGES
from harness import Cluster
from jobs import (
    RUNS,
    all_job_processes,
    background_playbook,
    controller_runs,
    finish,
    job_processes,
    latest_step,
    rank_pids,
    stage_dataset,
    wait_for,
)
from runner import TIMINGS, run_playbook

PER_NODE = 2  # ranks per node on the 4 nodes
RANKS = 4 * PER_NODE
LAYOUT = ("-e", f"ranks_per_node={PER_NODE}", "-e", f"mpi_ranks={RANKS}")


def _launcher(cluster: Cluster) -> int:
    """The job's mpiexec.hydra on the primary (run.sh's "mpirun")."""
    pids = subprocess.run(["ip", "netns", "pids", f"{cluster.prefix}-node1"], capture_output=True, text=True)
    for pid in pids.stdout.split():
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"mpiexec.hydra"):
                return int(pid)
    pytest.fail("no mpiexec.hydra in node1's namespace")


def _peak_rss(cluster: Cluster) -> list[int]:
    """Every training rank's peak resident memory so far (VmHWM, bytes; a fresh count from the rank's exec on)."""
    peaks = []
    for node in cluster.nodes:
        for pid in rank_pids(cluster, node):
            with contextlib.suppress(OSError):
                status = Path(f"/proc/{pid}/status").read_text()
                peaks += [int(x.split()[1]) * 1024 for x in status.splitlines() if x.startswith("VmHWM:")]
    return peaks


def _stopped_by_sigterm(cluster: Cluster, runs: Path, common: tuple[str, ...]) -> tuple[int, list[int]]:
    """Attempt 1 of the "stops" run, SIGTERM to its launcher on node1 (what an operator's kill or mpirun on abort
    sends): every one of the 8 ranks on the 4 nodes stops after the same step, rank 0 writes a checkpoint there,
    the play fails saying so, with the report. Returns that step and the ranks' peak RSS before the signal."""
    with background_playbook(
        cluster, "finetune-sigterm", "finetune.yml", *common, "-e", "finetune_max_train_steps=400"
    ) as (job, log, began):
        wait_for(lambda: latest_step(cluster) >= 2, 900, "step 2", job, log)
        peaks = _peak_rss(cluster)
        os.kill(_launcher(cluster), signal.SIGTERM)
        signalled = time.monotonic()
        wait_for(lambda: not all_job_processes(cluster), 300, "every rank to stop")
        stopped_after = time.monotonic() - signalled
        rc = finish(job, timeout=300)
        TIMINGS.append(("finetune.yml stopped by SIGTERM (1,000 images: latent cache built)", time.monotonic() - began))
    output = log.read_text()
    assert rc != 0
    said = re.search(
        r"Training stopped by SIGTERM at step (\d+) \(checkpoint-(\d+) written\); resume with -e resume", output
    )
    assert said and said[1] == said[2], output[-6000:]
    step = int(said[1])
    print(f"\nSIGTERM to mpiexec.hydra: {RANKS} ranks stopped at step {step}, all gone {stopped_after:.1f} s later")
    for node, rank in (("node1", 0), ("node3", 5), ("node4", RANKS - 1)):
        status = json.loads(cluster.ssh(node, f"cat {RUNS}/stops/status/rank-{rank}.json").stdout)
        assert (status["state"], status["step"], status["stop"]["signal"]) == ("interrupted", step, "SIGTERM"), status
    cluster.ssh("node1", f"test -f {RUNS}/stops/checkpoint-{step}/trainer_state.pt")
    ended = json.loads((runs / "stops" / "exit.json").read_text())
    # Every rank exits 143; mpiexec.hydra across 4 nodes returned 143 in one run and 255 in another (both seen
    # here): the play tells a stop from the ranks' status files, exit.json's `stopped`, not from the code.
    assert ended["rc"] in (143, 255) and ended["stopped"]["step"] == step, ended
    page = (runs / "stops" / "report.html").read_text()
    assert f"<h2>Stopped</h2><p>Attempt 1 stopped by SIGTERM at step {step} (checkpoint-{step} written)" in page
    return step, peaks


def _killed_node(cluster: Cluster, common: tuple[str, ...], checkpoint: int) -> list[int]:
    """Attempt 2 resumes from the SIGTERM's checkpoint; node3's processes are SIGKILLed two steps later: the job ends
    on every node within 60 s and the play fails naming node3 and its ranks. Returns the ranks' peak RSS before."""
    with background_playbook(
        cluster, "finetune-killed", "finetune.yml", *common, "-e", "resume=latest", "-e", "finetune_max_train_steps=400"
    ) as (job, log, began):
        wait_for(lambda: latest_step(cluster) >= checkpoint + 2, 900, f"step {checkpoint + 2}", job, log)
        peaks = _peak_rss(cluster)
        victims = job_processes(cluster, "node3")
        assert victims, "no training processes on node3"
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: not all_job_processes(cluster), 120, "every rank on every node to end")
        job_ended = time.monotonic() - killed
        rc = finish(job, timeout=300)
        play_ended = time.monotonic() - killed
        TIMINGS.append(
            ("finetune.yml resumed, node3 killed (1,000 images: latent cache reused)", time.monotonic() - began)
        )
    output = log.read_text()
    print(
        f"node3's processes killed: the job ended on every node {job_ended:.1f} s later, "
        f"the play failed {play_ended:.1f} s later (poll every 5 s)"
    )
    assert rc != 0
    assert job_ended < 60, f"the job took {job_ended:.0f} s to end"
    failure = output[output.index("Training failed:") :]
    assert failure.startswith("Training failed: node3 (ranks 4-5)"), failure[:2000]
    assert "[rank " in failure and "resume=latest" in failure
    # Who failed came from the ranks' status files, each on its own node: node3's killed ranks still say running.
    killed_rank = json.loads(cluster.ssh("node3", f"cat {RUNS}/stops/status/rank-4.json").stdout)
    assert (killed_rank["node"], killed_rank["state"], killed_rank["attempt"]) == ("node3", "running", 2), killed_rank
    assert cluster.ssh("node1", f"test -e {RUNS}/stops/status/rank-4.json", check=False).returncode != 0
    return peaks


def test_sigterm_stops_at_a_checkpoint_a_killed_node_fails_the_play_and_resume_finishes(provisioned: Cluster) -> None:
    """One run, three attempts (each a job start that the next one shares): a SIGTERM leaves a checkpoint at the step
    the ranks agreed on; resume=latest continues from it until a node is killed; resume=latest again finishes from
    the same checkpoint (nothing was saved after it: checkpoints only on a stop).

    The run trains on a real data set's size: 1,000 captioned images of mixed aspect ratios, staged by
    the dataset role, with aspect-ratio buckets and finetune_latent_cache_dir on each node's own disk. Attempt 1
    builds the latent cache in shards (each rank encodes only its images, each node's writer keeps the files);
    attempts 2 and 3 encode nothing; the summary gives the time to the first step; a rank's peak memory stays far
    below holding the images decoded."""
    runs = controller_runs(provisioned)
    staged = _stage_many_images(provisioned)
    common = (
        *("-e", f"controller_runs_dir={runs}", "-e", "finetune_checkpointing_steps=0", "-e", "finetune_run_id=stops"),
        *("-e", f"finetune_train_data_dir={MANY_DIR}", "-e", "finetune_buckets=true"),
        *("-e", f"finetune_latent_cache_dir={LATENTS_DIR}"),
        *LAYOUT,
    )
    step, encoding_peaks = _stopped_by_sigterm(provisioned, runs, common)
    reusing_peaks = _killed_node(provisioned, common, step)
    resumed = run_playbook(
        "finetune.yml",
        provisioned.inventory,
        *common,
        "-e",
        "resume=latest",
        "-e",
        f"finetune_max_train_steps={step + 2}",
        "--tags",
        "finetune",  # the training alone: the export is another test's
        state_dir=provisioned.state_dir,
        name="finetune-resumed",
        timeout=1800,
    )
    assert resumed.rc == 0, resumed.tail(80)
    rows = [json.loads(x) for x in (runs / "stops" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, step + 3))
    log = (runs / "stops" / "train.log").read_text()
    resumed_lines = [x for x in log.splitlines() if f"[rank 0/{RANKS}]" in x and f"resumed from {RUNS}/stops/" in x]
    assert len(resumed_lines) == 2, log[-3000:]  # attempts 2 and 3, both from the SIGTERM's checkpoint
    assert all(x.endswith(f"checkpoint-{step} at step {step}") for x in resumed_lines), resumed_lines
    assert json.loads((runs / "stops" / "exit.json").read_text())["attempt"] == 3
    resumed_rank = json.loads(provisioned.ssh("node3", f"cat {RUNS}/stops/status/rank-4.json").stdout)
    assert (resumed_rank["state"], resumed_rank["step"], resumed_rank["attempt"]) == ("done", step + 2, 3), resumed_rank
    assert (runs / "stops" / "report.html").exists()
    _check_the_latent_cache(provisioned, runs / "stops", log, encoding_peaks, reusing_peaks)
    print(f"staging {MANY_IMAGES} images on 4 nodes: {staged:.1f} s")


MANY_DIR = "/home/devcloud/many"  # the 1,000-image set on every node
LATENTS_DIR = "/home/devcloud/.cache/xeonsd-latents"  # each test node's own home: node-local


def _stage_many_images(cluster: Cluster) -> float:
    """The 1,000 images (made once on the controller) on every node through the dataset role (jobs.stage_dataset;
    that a second run changes nothing is tests/ansible/test_dataset_role.py's, on this machine). Returns the run's
    wall time."""
    from assets import make_many_images

    source = make_many_images(cluster.assets_dir)
    args = ("-e", f"dataset_dir={MANY_DIR}", "-e", f"dataset_expected_count={MANY_IMAGES}")
    staged = stage_dataset(cluster, "stage-many-images", source, *args)
    count = cluster.ssh("node4", f"ls {MANY_DIR} | grep -c '[.]png$'").stdout.strip()
    assert count == str(MANY_IMAGES), count
    return staged.seconds


_CACHE_LINE = re.compile(
    rf"\[rank (\d+)/{RANKS}\].* latent cache \S+: (\d+) of (\d+) image\(s\) reused, (\d+) encoded "
    r"\((\d+) input\(s\) on this rank\)"
)


def _check_the_latent_cache(
    cluster: Cluster, run: Path, log: str, encoding_peaks: list[int], reusing_peaks: list[int]
) -> None:
    """Attempt 1 encoded the 2,000 inputs (each image and its mirror) in shards: each rank its bucket-wise share
    (every 8th image of each bucket), each node the sum of its 2 ranks', every node keeping all 1,000 files;
    attempts 2 and 3 read them all and encoded nothing. The summary (attempt 3's) says so with the time to the
    first step. The ranks' peak RSS while encoding is no more than a fraction of the decoded images above their
    peak while reusing the cache: the images stream, one decoded at a time."""
    summary = json.loads((run / "train_summary.json").read_text())
    buckets = summary["buckets"]["buckets"]
    assert len(buckets) > 1 and sum(b["images"] for b in buckets) == MANY_IMAGES, summary["buckets"]
    startup = summary["startup"]
    assert (startup["latent_inputs"], startup["latent_inputs_encoded"]) == (2 * MANY_IMAGES, 0), startup
    assert startup["time_to_first_step_s"] > 0, startup
    found = [tuple(int(g) for g in m.groups()) for m in _CACHE_LINE.finditer(log)]
    assert len(found) == 3 * RANKS, found  # every rank of every attempt
    attempts = [sorted(found[RANKS * a : RANKS * a + RANKS]) for a in range(3)]
    share = [sum(2 * len(range(r, b["images"], RANKS)) for b in buckets) for r in range(RANKS)]
    assert attempts[0] == [(r, 0, MANY_IMAGES, MANY_IMAGES, share[r]) for r in range(RANKS)], attempts[0]
    assert sum(share) == 2 * MANY_IMAGES
    for later in attempts[1:]:
        assert later == [(r, MANY_IMAGES, MANY_IMAGES, 0, 0) for r in range(RANKS)], later
    for node in cluster.nodes:
        files = cluster.ssh(node, f"ls {LATENTS_DIR} | grep -c '[.]safetensors$'").stdout.strip()
        assert files == str(MANY_IMAGES), (node, files)
    first_steps = re.findall(rf"\[rank 0/{RANKS}\].* time to first step: ([0-9.]+) s", log)
    assert len(first_steps) == 3, first_steps
    decoded = sum(b["images"] * 2 * 3 * b["width"] * b["height"] * 4 for b in buckets)  # float32, image + mirror
    assert len(encoding_peaks) == len(reusing_peaks) == RANKS, (encoding_peaks, reusing_peaks)
    assert min(encoding_peaks + reusing_peaks) > 100e6, (encoding_peaks, reusing_peaks)  # the ranks, not a wrapper
    assert max(encoding_peaks) - max(reusing_peaks) < decoded / 2, (encoding_peaks, reusing_peaks, decoded)
    print(
        f"\n{MANY_IMAGES} images, buckets {[(b['width'], b['height'], b['images']) for b in buckets]}: inputs encoded "
        f"per node {[sum(share[PER_NODE * i : PER_NODE * i + PER_NODE]) for i in range(4)]}; time to first step (rank 0) "
        f"{' / '.join(first_steps)} s (cache built / reused / reused); peak RSS per rank max "
        f"{max(encoding_peaks) / 1e6:.0f} MB encoding, {max(reusing_peaks) / 1e6:.0f} MB reusing; all images "
        f"decoded would be {decoded / 1e6:.0f} MB"
    )
