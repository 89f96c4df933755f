"""The served model: the OpenVINO tests' session export ``ov_base`` (tiny SD, static batch 5 at 64 px), a LoRA
adapter for it, made the way our trainer writes one, and their learned concept ``embeds`` (tests/xeonsd/openvino/
ov_assets.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from ov_assets import peft_adapter  # tests/xeonsd/conftest.py puts it on the path and defines ov_base, embeds


@pytest.fixture(scope="session")
def toy_adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A UNet LoRA in the diffusers layout with random up matrices: it visibly changes the image."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(tiny_model / "unet")
    return peft_adapter(unet, tmp_path_factory.mktemp("serve-lora"), ["to_k", "to_v", "ff.net.2"], seed=1, scale=0.5)


@pytest.fixture(scope="session")
def other_adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second UNet LoRA (other layers, other seed), for the blends."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(tiny_model / "unet")
    return peft_adapter(unet, tmp_path_factory.mktemp("serve-lora-2"), ["to_q", "to_out.0"], seed=2, scale=0.5)


@pytest.fixture(scope="session")
def edit_server(ov_base: Path, toy_adapter: Path, other_adapter: Path):  # noqa: F811 - the fixture
    """One server for test_serve_edits.py and test_serve_blends.py: the tiny export, two adapters, two declared
    blends, one worker."""
    from serve_process import ServeProcess

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    with ServeProcess.running(
        ov_base,
        "--name=base",
        f"--adapter=toy={toy_adapter}",
        f"--adapter=other={other_adapter}:0.8",
        "--blend=@toy:0.7+@other:0.5",  # test_serve_blends.py: a blend, and a blend of one
        "--blend=@toy:0.5",
        "--workers=1",
        "--queue=4",
        "--max-images=5",
        env=env,
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def cli_env_module() -> dict[str, str]:
    """The environment of a served process: offline, unbuffered, this venv's scripts first on PATH."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env
