"""What every ``xeonsd`` command imports before it runs: the parser (whose ``make-tiny-model --arch`` choices list
every family folder's archs) and, for the commands the playbooks run on a node for every job (``xeonsd report``;
``runjson`` and ``jobstatus`` are :mod:`xeonsd.jobs`, standard library only: test_imports.py), their modules. None
of it may import the machine-learning stack: on a loaded node that took 20 s of CPU per command (a family's assets
module had imported its processor, and with it transformers and torch, at module level)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from repo_code import REPO

HEAVY = {"torch", "transformers", "diffusers", "openvino", "optimum", "matplotlib"}


def loaded(*modules: str) -> set[str]:
    """The top-level packages in ``sys.modules`` of a fresh interpreter after it built xeonsd's parser and imported
    ``modules``."""
    code = (
        "import importlib, json, sys\nfrom xeonsd import cli\ncli.build_parser()\n"
        "for m in sys.argv[1:]: importlib.import_module(m)\n"
        "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "train" / "src")}
    out = subprocess.run([sys.executable, "-c", code, *modules], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_parser_and_the_report_import_no_ml_stack() -> None:
    found = loaded("xeonsd.ops.report", "xeonsd.jobs.cli")
    assert "xeonsd" in found
    assert not found & HEAVY, f"xeonsd report imports {sorted(found & HEAVY)} before it runs"


def test_the_check_sees_a_heavy_import() -> None:
    found = loaded("xeonsd.families.qwenimage_edit.processor")
    assert "transformers" in found & HEAVY


def test_a_bad_train_flag_is_refused_before_the_ml_stack_loads(tmp_path) -> None:
    """`xeonsd train` checks a single process's flags before it imports torch (seconds): another method's flag is
    refused with the trainer's message and exit code 2, and nothing of the stack was loaded."""
    code = (
        "import json, sys\nfrom xeonsd import cli\n"
        "rc = cli.main(sys.argv[1:])\n"
        "print(json.dumps([rc, sorted({n.split('.')[0] for n in sys.modules})]))"
    )
    argv = ["train", "--method=lora", "--placeholder_token=<x>", "--pretrained_model_name_or_path=m",
            f"--train_data_dir={tmp_path}", f"--output_dir={tmp_path / 'out'}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "train" / "src")}
    out = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=300)
    rc, modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert rc == 2 and "does not use --placeholder_token (a textual_inversion flag)" in out.stderr, out.stderr
    assert not HEAVY & set(modules), HEAVY & set(modules)
    assert not (tmp_path / "out").exists()  # nothing written for a refused job
