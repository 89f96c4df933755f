"""The Ansible content passes yamllint and ansible-lint's production profile, and parses as playbooks."""

from __future__ import annotations

import os
import subprocess

from repo_code import REPO, VENV_BIN


def run(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), NO_COLOR="1", ANSIBLE_NOCOLOR="1")
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        [str(VENV_BIN / argv[0]), *argv[1:]], cwd=REPO, env=env, text=True, capture_output=True, timeout=600
    )


def test_yamllint_is_clean() -> None:
    result = run("yamllint", "--strict", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ansible_lint_production_profile_is_clean() -> None:
    result = run("ansible-lint", "--profile", "production")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]


def test_playbooks_parse() -> None:
    result = run(
        "ansible-playbook", "--syntax-check", "provision.yml", "doctor.yml", "finetune.yml", "export.yml", "serve.yml"
    )
    assert result.returncode == 0, result.stdout + result.stderr
