"""Shared fixtures: the offline tiny Stable Diffusion pipeline and the synthetic image set, built once a session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from xeonsd.assets import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("assets") / "tiny-sd")


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from xeonsd.assets import make_dataset

    out = tmp_path_factory.mktemp("assets") / "dicoo"
    make_dataset(out, count=5, size=64)
    return out


@pytest.fixture
def cli_env() -> dict[str, str]:
    """Environment for running the xeonsd CLI in a subprocess: offline, quiet, small thread counts."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    return env
