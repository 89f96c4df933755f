"""Running the ``xeonsd`` CLI from the tests: the short runs' arguments, one rank or several under real mpirun,
and the refusal check. Imported by the trainer's, cluster's, OpenVINO and role tests alike."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import cli_forkserver

if TYPE_CHECKING:  # torch is imported where a test uses it (the role tests import this module too)
    import torch

TOKEN = "<dicoo>"


def train_args(model: Path, data: Path, out: Path, *extra: str, steps: int = 4, batch: int = 1) -> list[str]:
    """A short fp32 run at 64 px: fast on the tiny model, and exact enough to compare runs."""
    return [
        f"--pretrained_model_name_or_path={model}",
        f"--train_data_dir={data}",
        "--placeholder_token",
        TOKEN,
        "--initializer_token",
        "toy",
        "--resolution=64",
        f"--train_batch_size={batch}",
        "--seed=7",
        f"--max_train_steps={steps}",
        "--learning_rate=5e-3",
        "--lr_warmup_steps=0",
        "--checkpointing_steps=0",
        f"--output_dir={out}",
        *extra,
    ]


def initial_vector(model: Path) -> torch.Tensor:
    """What the placeholder's vector starts as: the initializer token's ("toy") row of the text encoder's
    embedding table, the point a run that learned nothing ends at."""
    from safetensors.torch import load_file
    from transformers import CLIPTokenizer

    (token_id,) = CLIPTokenizer.from_pretrained(model, subfolder="tokenizer").encode("toy", add_special_tokens=False)
    table = load_file(str(model / "text_encoder" / "model.safetensors"))["text_model.embeddings.token_embedding.weight"]
    return table[token_id]


def assert_learned(vectors: torch.Tensor, model: Path) -> None:
    """Every learned vector moved away from the initializer's row: the run trained (two runs that learned nothing
    would agree with each other too)."""
    moved = (vectors - initial_vector(model)).abs().amax(dim=-1)
    assert (moved > 1e-4).all(), f"the placeholder vector did not learn: largest change per vector {moved.tolist()}"


def run_cli(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m xeonsd.cli ARGS`` in a process of its own, forked from the worker's warm CLI process where the
    environment allows (cli_forkserver.py: the imports are most of a short run's CPU)."""
    return cli_forkserver.run(args, env, timeout)


def mpi_env(env: dict[str, str]) -> dict[str, str]:
    env = dict(env)
    env.setdefault("I_MPI_FABRICS", "shm")
    env["MASTER_PORT"] = str(29600 + os.getpid() % 200)
    return env


def refused(args: list[str], env: dict[str, str]) -> str:
    proc = run_cli(["train", *args], env)
    assert proc.returncode == 2, f"expected exit 2, got {proc.returncode}: {proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr
    return proc.stderr


def method_args(method: str, model: Path, data: Path, out: Path, *extra: str, steps: int = 3, batch: int = 1):
    args = [
        f"--method={method}",
        f"--pretrained_model_name_or_path={model}",
        f"--train_data_dir={data}",
        "--resolution=64",
        f"--train_batch_size={batch}",
        "--seed=7",
        f"--max_train_steps={steps}",
        "--learning_rate=1e-3",
        "--lr_warmup_steps=0",
        "--checkpointing_steps=0",
        f"--output_dir={out}",
    ]
    if method == "textual_inversion":
        args += ["--placeholder_token=<dicoo>", "--initializer_token=toy"]
    return [*args, *extra]


def train(args: list[str], env: dict[str, str], ranks: int = 1) -> subprocess.CompletedProcess:
    if ranks == 1:
        proc = run_cli(["train", *args], env)
    else:
        mpirun, env = shutil.which("mpirun", path=env["PATH"]), mpi_env(env)
        cmd = [mpirun, "-n", str(ranks), *cli_forkserver.rank_command(env), "train", *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc
