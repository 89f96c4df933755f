"""Training with aspect-ratio buckets on 200 captioned images of mixed sizes (``make-dataset --sizes mixed``, at the
tiny model's 64 px: buckets 48x80, 64x64, 80x48 at step 16), three short runs shared by the tests:

* ``two``: 2 ranks x batch 1 under real mpirun, building the disk latent cache in shards (each rank encodes its
  half of the images);
* ``one``: 1 rank x batch 2 on the same cache: it encodes nothing, and learns what ``two`` learned;
* ``resumed``: ``one`` resumed from its step-2 checkpoint: it ends where ``one`` ended.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_runs import TOKEN, assert_learned, mpi_env, run_cli, train_args
from safetensors.torch import load_file

IMAGES = 200
BUCKET_FLAGS = ["--buckets", "--min_bucket_reso=48", "--max_bucket_reso=80", "--bucket_reso_steps=16"]
CACHE_LINE = re.compile(
    r"\[rank (\d)/\d\] INFO xeonsd\.trainer\.latents: latent cache .*: (\d+) of (\d+) image\(s\) reused, "
    r"(\d+) encoded \((\d+) input\(s\) on this rank\)"
)


def vectors(out: Path) -> torch.Tensor:
    return load_file(str(out / "learned_embeds.safetensors"))[TOKEN]


def summary(out: Path) -> dict:
    return json.loads((out / "train_summary.json").read_text())


def cache_lines(stderr: str) -> dict[int, tuple[int, int, int, int]]:
    """Each rank's latent cache line: (reused, images, encoded images, inputs encoded on this rank)."""
    return {int(m[1]): tuple(int(g) for g in m.groups()[1:]) for m in CACHE_LINE.finditer(stderr)}


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    from xeonsd.assets import make_dataset

    root = tmp_path_factory.mktemp("buckets")
    data = root / "mixed"
    make_dataset(data, count=IMAGES, size=64, sizes="mixed", captions="metadata")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cache = f"--latent_cache_dir={root / 'cache'}"
    out = {name: root / name for name in ("two", "one", "resumed")}
    mpirun = shutil.which("mpirun", path=env["PATH"])
    assert mpirun, "mpirun (impi-rt) is not installed in the environment"
    cmd = [mpirun, "-n", "2", sys.executable, "-m", "xeonsd.cli", "train"]
    two = subprocess.run(
        [*cmd, *train_args(tiny_model, data, out["two"], *BUCKET_FLAGS, cache)],
        env=mpi_env(env),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    one = run_cli(
        ["train", *train_args(tiny_model, data, out["one"], *BUCKET_FLAGS, cache, "--checkpointing_steps=2", batch=2)],
        env,
        timeout=600,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    out["resumed"].mkdir()
    shutil.copytree(out["one"] / "checkpoint-2", out["resumed"] / "checkpoint-2")
    args = train_args(
        tiny_model, data, out["resumed"], *BUCKET_FLAGS, cache, "--resume_from_checkpoint=latest", batch=2
    )
    resumed = run_cli(["train", *args], env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    return {"out": out, "log": {"two": two.stderr, "one": one.stderr}}


def test_the_ranks_share_the_latent_cache_and_the_next_run_reuses_it(runs):
    two = cache_lines(runs["log"]["two"])
    assert sorted(two) == [0, 1], runs["log"]["two"][-3000:]
    assert all(line[:3] == (0, IMAGES, IMAGES) for line in two.values())
    # Each rank encoded its share: every other image, both the image and its mirror.
    assert [two[r][3] for r in (0, 1)] == [IMAGES, IMAGES]
    assert summary(runs["out"]["two"])["startup"]["latent_inputs_encoded"] == 2 * IMAGES
    assert cache_lines(runs["log"]["one"]) == {0: (IMAGES, IMAGES, 0, 0)}
    assert summary(runs["out"]["one"])["startup"]["latent_inputs_encoded"] == 0


def test_the_buckets_and_the_time_to_the_first_step_are_reported(runs):
    record = summary(runs["out"]["two"])
    sizes = [(b["width"], b["height"]) for b in record["buckets"]["buckets"]]
    assert sizes == [(48, 80), (64, 64), (80, 48)]
    counts = [b["images"] for b in record["buckets"]["buckets"]]
    assert sum(counts) == IMAGES and min(counts) > 0
    assert "aspect-ratio buckets: 3 bucket(s) (step 16, 48-80 px): 48x80: " in runs["log"]["two"]
    startup = record["startup"]
    assert startup["latent_inputs"] == 2 * IMAGES and startup["time_to_first_step_s"] > 0
    assert startup["cpu_s_to_first_step"] > 0  # the process's own CPU, its imports included
    line = r"\[rank 0/2\] INFO xeonsd\.train: time to first step: [\d.]+ s .*; [\d.]+ CPU s since the process started"
    assert re.search(line, runs["log"]["two"])
    print(
        f"{IMAGES} images: time to first step {startup['time_to_first_step_s']:.1f} s, rank 0 "
        f"{startup['cpu_s_to_first_step']:.1f} CPU s (2 ranks, cache built), "
        f"{summary(runs['out']['one'])['startup']['time_to_first_step_s']:.1f} s (1 rank, cache reused)"
    )


def test_two_ranks_with_buckets_learn_what_one_rank_with_double_batch_learns(runs, tiny_model):
    """Tolerance 1e-5 absolute: only the order of float additions in the gradient average differs."""
    two, one = vectors(runs["out"]["two"]), vectors(runs["out"]["one"])
    assert_learned(one, tiny_model)
    torch.testing.assert_close(two, one, atol=1e-5, rtol=0)


def test_resume_with_buckets_ends_where_the_uninterrupted_run_ends(runs, tiny_model):
    assert_learned(vectors(runs["out"]["one"]), tiny_model)
    torch.testing.assert_close(vectors(runs["out"]["resumed"]), vectors(runs["out"]["one"]), atol=1e-6, rtol=0)
