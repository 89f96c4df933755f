"""The trainer on the tiny model: recipe flags, what it learns, what it writes, and how it runs over MPI."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_runs import TOKEN, assert_learned, initial_vector, mpi_env, refused, run_cli, train_args
from safetensors.torch import load_file

from xeonsd.trainer.argv import parse_config

# The recipe's command line, verbatim, after `xeonsd train` (paths filled in by the tests).
RECIPE_FLAGS = [
    "--learnable_property=object",
    '--placeholder_token="<dicoo>"'.replace('"', ""),
    "--initializer_token=toy",
    "--resolution=512",
    "--train_batch_size=1",
    "--seed=7",
    "--gradient_accumulation_steps=1",
    "--max_train_steps=200",
    "--learning_rate=2.0e-03",
    "--scale_lr",
    "--lr_scheduler=constant",
    "--lr_warmup_steps=0",
    "--output_dir=./textual_inversion_output",
    "--mixed_precision",
    "bf16",
    "--save_as_full_pipeline",
]


def vectors(out: Path) -> torch.Tensor:
    return load_file(str(out / "learned_embeds.safetensors"))[TOKEN]


def test_recipe_command_line_parses_verbatim():
    cfg = parse_config(["--pretrained_model_name_or_path=m", "--train_data_dir=d", *RECIPE_FLAGS])
    assert cfg.placeholder_token == "<dicoo>"
    assert cfg.initializer_token == "toy"
    assert cfg.resolution == 512 and cfg.train_batch_size == 1 and cfg.seed == 7
    assert cfg.max_train_steps == 200 and cfg.learning_rate == pytest.approx(2e-3)
    assert cfg.scale_lr and cfg.save_as_full_pipeline
    assert cfg.mixed_precision == "bf16" and cfg.lr_scheduler == "constant" and cfg.lr_warmup_steps == 0


def test_recipe_run_writes_every_output(tiny_model, dataset, tmp_path, cli_env):
    """The recipe's flags (bf16, full pipeline) end to end, with only the step count and resolution shortened; and
    the run imports neither scikit-learn nor SciPy (xeonsd.trainer.libraries: every rank would pay for them)."""
    out = tmp_path / "out"
    flags = [f for f in RECIPE_FLAGS if not f.startswith(("--max_train_steps", "--resolution", "--output_dir"))]
    args = ["train", f"--pretrained_model_name_or_path={tiny_model}", f"--train_data_dir={dataset}", *flags]
    args += ["--max_train_steps=3", "--resolution=64", f"--output_dir={out}"]
    proc = run_cli(args, {**cli_env, "PYTHONPROFILEIMPORTTIME": "1"})  # each import, on stderr (or the log)
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = proc.stderr + (out / "libraries.log").read_text()
    assert "| xeonsd.trainer.loop" in imported  # the import lines are there: the check below can see them
    assert not re.findall(r"\| +(?:sklearn|scipy)(?:\.[\w.]+)?$", imported, re.MULTILINE)
    assert vectors(out).shape == (1, 32)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert {"loss", "lr", "s_per_step", "images_per_s", "ranks"} <= rows[0].keys()
    # --scale_lr: 2e-3 x accumulation 1 x batch 1 x 1 rank
    assert rows[0]["lr"] == pytest.approx(2e-3)
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert not (out / "metrics.partial.jsonl").exists()
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(out)
    assert TOKEN in pipe.tokenizer.get_vocab()
    assert "rank 0/1" in proc.stderr and "dtype=bfloat16" in proc.stderr


def test_only_placeholder_rows_change(tiny_model, dataset, tmp_path, cli_env):
    out = tmp_path / "out"
    proc = run_cli(["train", *train_args(tiny_model, dataset, out, "--save_as_full_pipeline")], cli_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from transformers import CLIPTextModel

    base = CLIPTextModel.from_pretrained(tiny_model, subfolder="text_encoder").state_dict()
    tuned = CLIPTextModel.from_pretrained(out, subfolder="text_encoder").state_dict()
    key = "text_model.embeddings.token_embedding.weight"
    n = base[key].shape[0]
    assert tuned[key].shape[0] == n + 1
    assert torch.equal(tuned[key][:n], base[key]), "a row other than the placeholder changed"
    for name, tensor in base.items():
        if name != key:
            assert torch.equal(tuned[name], tensor), f"{name} changed"
    assert not torch.allclose(tuned[key][n], initial_vector(tiny_model)), "the placeholder vector did not learn"
    assert torch.equal(tuned[key][n], vectors(out)[0])


def test_two_ranks_learn_what_one_rank_with_double_batch_learns(tiny_model, dataset, tmp_path, cli_env):
    """2 ranks x batch 1 under real mpirun == 1 rank x batch 2. Tolerance: 1e-5 absolute on the vectors (only
    the order of float additions in the gradient average differs)."""
    one = tmp_path / "one"
    proc = run_cli(["train", *train_args(tiny_model, dataset, one, batch=2)], cli_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = tmp_path / "two"
    mpirun = shutil.which("mpirun", path=cli_env["PATH"])
    assert mpirun, "mpirun (impi-rt) is not installed in the environment"
    cmd = [
        mpirun,
        "-n",
        "2",
        sys.executable,
        "-m",
        "xeonsd.cli",
        "train",
        *train_args(tiny_model, dataset, two, "--stats_every=3"),
    ]
    env = {**mpi_env(cli_env), "XEONSD_NODE_NAMES": "127.0.0.1=here"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "rank 1/2" in proc.stderr and "backend=gloo" in proc.stderr
    rows = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    assert all(r["ranks"] == 2 and r["backend"] == "gloo" for r in rows)
    # Every 3 steps and at the last one, rank 0 gathered both ranks' CPU use and time split, with the node's name.
    assert [r["step"] for r in rows if "rank_stats" in r] == [3, 4]
    stats = rows[-1]["rank_stats"]
    assert [r["rank"] for r in stats["ranks"]] == [0, 1] and stats["nodes"][0]["node"] == "here"
    for r in stats["ranks"]:
        assert 0 < r["cpu_util"] < 2 and r["compute_s"] > 0 and r["allreduce_s"] >= 0 and r["data_s"] > 0
    assert rows[-1]["stragglers"] == []
    assert stats["nodes"][0]["cores"] >= 1 and stats["nodes"][0]["threads"] >= 1  # the layout verdict's figures
    print(f"2 ranks, one node: cpu_util {stats['cpu_util']}, per rank {stats['ranks']}")
    # Each rank's PSS, shared and private bytes in its status file (the last stats interval's); rank 0's node total
    # in the metrics rows (after loading, and each interval) is their sum, and in the log.
    ranks = [json.loads((two / "status" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert all(s["pss_bytes"] > 0 and s["private_bytes"] > 0 and s["shared_bytes"] >= 0 for s in ranks)
    (node,) = rows[-1]["memory"]["nodes"]
    assert (node["node"], node["ranks"], node["pss_bytes"]) == ("here", [0, 1], sum(s["pss_bytes"] for s in ranks))
    assert (
        rows[0]["memory_loaded"]["nodes"][0]["measured_ranks"] == 2 and "memory after loading: here PSS" in proc.stderr
    )
    v1, v2 = vectors(one), vectors(two)
    assert_learned(v1, tiny_model)
    torch.testing.assert_close(v2, v1, atol=1e-5, rtol=0)


def test_resume_under_mpirun_continues_the_same_trajectory(tiny_model, dataset, tmp_path, cli_env):
    """Rank 0 reads the checkpoint and broadcasts it: a resumed 2-rank run ends where an uninterrupted one does."""
    mpirun = shutil.which("mpirun", path=cli_env["PATH"])
    env = mpi_env(cli_env)
    full, part = tmp_path / "full", tmp_path / "part"
    base = [mpirun, "-n", "2", sys.executable, "-m", "xeonsd.cli", "train"]
    proc = subprocess.run(
        [*base, *train_args(tiny_model, dataset, full, "--checkpointing_steps=3", steps=6)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    part.mkdir()
    shutil.copytree(full / "checkpoint-3", part / "checkpoint-3")
    args = train_args(tiny_model, dataset, part, "--resume_from_checkpoint=latest", steps=6)
    proc = subprocess.run([*base, *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr
    assert_learned(vectors(full), tiny_model)
    torch.testing.assert_close(vectors(part), vectors(full), atol=1e-6, rtol=0)


def test_cached_latents_match_per_step_encoding(tiny_model, dataset, tmp_path, cli_env):
    """Same seed, with and without the latent cache: the cache draws each step's latent from the same
    distribution with the same random numbers, so the runs agree to float rounding (1e-5)."""
    cached, encoded = tmp_path / "cached", tmp_path / "encoded"
    for out, flag in ((cached, "--latent_cache"), (encoded, "--no-latent_cache")):
        proc = run_cli(["train", *train_args(tiny_model, dataset, out, flag)], cli_env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert_learned(vectors(encoded), tiny_model)
    torch.testing.assert_close(vectors(cached), vectors(encoded), atol=1e-5, rtol=0)


def test_cached_distribution_equals_encoder_distribution(tiny_model, dataset):
    """Samples from the cached (mean, std) and from fresh encodes have matching moments for every input."""
    from diffusers import AutoencoderKL

    from xeonsd.trainer.data import find_images, load_all_pixels
    from xeonsd.trainer.latents import build_latent_cache, sample_latents

    vae = AutoencoderKL.from_pretrained(tiny_model, subfolder="vae")
    pixels = load_all_pixels(find_images(dataset), 64, False, 0)
    mean, std = build_latent_cache(vae, len(pixels), lambda i: pixels[i : i + 1], torch.float32, (4, 8, 8), 0, 1)
    g = torch.Generator().manual_seed(0)
    n = 400
    with torch.no_grad():
        direct = torch.stack([vae.encode(pixels[:2]).latent_dist.sample(generator=g) for _ in range(n)])
    eps = torch.randn((n, 2, 4, 8, 8), generator=g)
    cached = sample_latents(mean[:2], std[:2], eps, 1.0)
    torch.testing.assert_close(cached.mean(0), direct.mean(0), atol=4 * std[:2].max().item() / n**0.5, rtol=0)
    torch.testing.assert_close(cached.std(0), direct.std(0), rtol=0.2, atol=1e-4)


def test_resume_after_kill_continues_the_same_trajectory(tiny_model, dataset, tmp_path, cli_env):
    steps = 60  # long enough that the kill at the first checkpoint lands mid-run
    full = tmp_path / "full"
    proc = run_cli(["train", *train_args(tiny_model, dataset, full, steps=steps)], cli_env)
    assert proc.returncode == 0, proc.stderr[-3000:]

    out = tmp_path / "killed"
    args = train_args(tiny_model, dataset, out, "--checkpointing_steps=3", "--checkpoints_total_limit=2", steps=steps)
    proc = subprocess.Popen(
        [sys.executable, "-m", "xeonsd.cli", "train", *args],
        env=cli_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    while not (out / "checkpoint-3").exists():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (out / "learned_embeds.safetensors").exists()
    assert not (out / "metrics.jsonl").exists(), "a killed run left a finished-looking metrics file"

    args = train_args(tiny_model, dataset, out, "--resume_from_checkpoint=latest", steps=steps)
    proc = run_cli(["train", *args], cli_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr
    assert_learned(vectors(full), tiny_model)
    torch.testing.assert_close(vectors(out), vectors(full), atol=1e-6, rtol=0)
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, steps + 1))


@pytest.mark.parametrize("num_vectors", [1, 2])
def test_saved_embeddings_load_in_diffusers_and_change_the_prompt(tiny_model, dataset, tmp_path, cli_env, num_vectors):
    out = tmp_path / "out"
    proc = run_cli(["train", *train_args(tiny_model, dataset, out, f"--num_vectors={num_vectors}")], cli_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert vectors(out).shape == (num_vectors, 32)
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(tiny_model)
    before, _ = pipe.encode_prompt("a photo of a toy", "cpu", 1, False)
    pipe.load_textual_inversion(str(out / "learned_embeds.safetensors"))
    assert TOKEN in pipe.tokenizer.get_vocab()
    if num_vectors == 2:
        assert f"{TOKEN}_1" in pipe.tokenizer.get_vocab()
    after, _ = pipe.encode_prompt(f"a photo of a {TOKEN}", "cpu", 1, False)
    assert not torch.allclose(before, after, atol=1e-3), "the learned concept does not change the prompt encoding"


# ---- bad input: a clear error before any training, naming the problem ------------------------------------------


def test_missing_data_dir(tiny_model, tmp_path, cli_env):
    err = refused(train_args(tiny_model, tmp_path / "nope", tmp_path / "o"), cli_env)
    assert "nope does not exist" in err


def test_data_dir_without_images(tiny_model, tmp_path, cli_env):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    assert "holds no images" in refused(train_args(tiny_model, tmp_path / "empty", tmp_path / "o"), cli_env)


def test_unreadable_image_is_named(tiny_model, dataset, tmp_path, cli_env):
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    (data / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    assert "broken.png" in refused(train_args(tiny_model, data, tmp_path / "o"), cli_env)


def test_a_latent_cache_dir_that_cannot_be_created_is_refused_before_loading(tiny_model, dataset, tmp_path, cli_env):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = tmp_path / "o"
    err = refused(train_args(tiny_model, dataset, out, f"--latent_cache_dir={blocker / 'latents'}"), cli_env)
    assert f"--latent_cache_dir {blocker / 'latents'} cannot be created" in err
    assert err.count("error") == 1 and not out.exists()


def test_placeholder_already_in_vocabulary(tiny_model, dataset, tmp_path, cli_env):
    args = train_args(tiny_model, dataset, tmp_path / "o")
    args[args.index(TOKEN)] = "photo"
    assert "'photo' is already in the tokenizer's vocabulary" in refused(args, cli_env)


@pytest.mark.parametrize("init", ["toy robot", "xqzv"])
def test_initializer_must_be_one_token(tiny_model, dataset, tmp_path, cli_env, init):
    args = train_args(tiny_model, dataset, tmp_path / "o")
    args[args.index("toy")] = init
    assert "must be exactly one token" in refused(args, cli_env)


def test_resolution_not_multiple_of_8(tiny_model, dataset, tmp_path, cli_env):
    assert "multiple of 8" in refused(train_args(tiny_model, dataset, tmp_path / "o", "--resolution=100"), cli_env)


def test_fp16_on_cpu(tiny_model, dataset, tmp_path, cli_env):
    err = refused(train_args(tiny_model, dataset, tmp_path / "o", "--mixed_precision=fp16"), cli_env)
    assert "fp16" in err and "bf16" in err


def test_missing_checkpoint(tiny_model, dataset, tmp_path, cli_env):
    err = refused(train_args(tiny_model, dataset, tmp_path / "o", "--resume_from_checkpoint=checkpoint-9"), cli_env)
    assert "checkpoint-9" in err and "no checkpoint" in err


def test_world_size_mismatch(tiny_model, dataset, tmp_path, cli_env):
    env = dict(cli_env, PMI_RANK="0", PMI_SIZE="2", MPI_LOCALRANKID="0", MPI_LOCALNRANKS="2")
    err = refused(train_args(tiny_model, dataset, tmp_path / "o", "--world_size=4"), env)
    assert "--world_size 4" in err and "2 rank(s)" in err


def test_output_dir_with_an_earlier_run_is_not_overwritten(tiny_model, dataset, tmp_path, cli_env):
    out = tmp_path / "o"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    err = refused(train_args(tiny_model, dataset, out), cli_env)
    assert "already holds a run" in err and "--overwrite_output_dir" in err
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 0.5}\n'


def test_missing_model_dir(dataset, tmp_path, cli_env):
    err = refused(train_args(tmp_path / "no-model", dataset, tmp_path / "o"), cli_env)
    assert "no-model" in err


def test_a_hub_id_the_hub_cannot_serve_fails_at_once_with_what_to_do(dataset, tmp_path, cli_env):
    """A typo, or a Hub id on a node without network: one line and exit 2, not a traceback after five retries."""
    env = {k: v for k, v in cli_env.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT="https://hub.invalid", HF_HUB_CACHE=str(tmp_path / "hub-cache"))  # never resolves
    err = refused(train_args(Path("nope/dir"), dataset, tmp_path / "o"), env)
    last = err.strip().splitlines()[-1]
    assert last.startswith("xeonsd train: error: --pretrained_model_name_or_path nope/dir: ")
    assert "looked for as a local directory (not found) and on the Hub (host hub.invalid does not resolve)" in last
    assert "local diffusers pipeline directory" in last and "base_model role" in last and "HF_HUB_OFFLINE=1" in last
    assert "Retry" not in err  # the download client was never asked
    err = refused(train_args(Path("nope/dir"), dataset, tmp_path / "o"), dict(env, HF_HUB_OFFLINE="1"))
    assert "on the Hub (offline: HF_HUB_OFFLINE=1, and the Hub cache" in err.strip().splitlines()[-1]


def test_a_hub_id_in_the_hub_cache_trains_offline(tiny_model, dataset, tmp_path, cli_env):
    """Nodes without network whose Hub cache holds the model (rather than a staged directory) still train."""
    commit = "0" * 40
    repo = tmp_path / "hub-cache" / "models--owner--tiny-sd"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(tiny_model, repo / "snapshots" / commit)
    env = dict(cli_env, HF_HUB_CACHE=str(tmp_path / "hub-cache"))
    proc = run_cli(["train", *train_args(Path("owner/tiny-sd"), dataset, tmp_path / "o", steps=1)], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert vectors(tmp_path / "o").shape == (1, 32)


def test_validation_images_and_periodic_embeddings(tiny_model, dataset, tmp_path, cli_env):
    out = tmp_path / "out"
    extra = [
        "--validation_prompt=a photo of a <dicoo>",
        "--num_validation_images=2",
        "--validation_steps=2",
        "--save_steps=2",
        "--learnable_property=style",
        "--center_crop",
        "--dataloader_num_workers=2",
    ]
    proc = run_cli(["train", *train_args(tiny_model, dataset, out, *extra, steps=2)], cli_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from PIL import Image

    for sub in ("step-2", "final"):
        files = sorted((out / "validation" / sub).glob("*.png"))
        assert len(files) == 2
        assert Image.open(files[0]).size == (64, 64)
    # one grid of them: a column per evaluation (step 2, final) under its label, a row per image, 128 px cells
    grid = Image.open(out / "validation_grid.png")
    assert grid.size == (2 * 128, 16 + 2 * 128)
    cell = np.asarray(grid.convert("RGB"))[16 + 128 :, 128:]  # image 1 of the final evaluation
    final = np.asarray(Image.open(out / "validation" / "final" / "01.png").convert("RGB").resize((128, 128)))
    assert np.array_equal(cell, final)
    torch.testing.assert_close(load_file(str(out / "learned_embeds-steps-2.safetensors"))[TOKEN], vectors(out))
