"""The entry playbooks' tags (docs/playbooks.md#tags): every role of theirs is tagged with its name, and
`--tags dataset` runs the dataset role (and the verified_tree tasks it brings) after preflight, nothing else."""

from __future__ import annotations

import os
import re
import subprocess

import yaml
from repo_code import REPO, VENV_BIN

PLAYBOOKS = ("provision.yml", "doctor.yml", "finetune.yml", "export.yml", "serve.yml")


def run(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), NO_COLOR="1", ANSIBLE_NOCOLOR="1")
    return subprocess.run(
        [str(VENV_BIN / argv[0]), *argv[1:]], cwd=REPO, env=env, text=True, capture_output=True, timeout=300
    )


def play_roles() -> dict[str, list]:
    """{role name: its tags} over playbooks/*.yml, whose roles are the collection's, by their full names."""
    roles = {}
    for path in sorted((REPO / "playbooks").glob("*.yml")):
        for play in yaml.safe_load(path.read_text()):
            for role in play.get("roles", []):
                assert role["role"].startswith("xeonsd.cluster."), (path, role)
                roles[role["role"].removeprefix("xeonsd.cluster.")] = role.get("tags", [])
    return roles


def test_every_role_of_the_entry_playbooks_is_tagged_with_its_name_and_documented() -> None:
    roles = play_roles()
    assert roles and all(name in tags for name, tags in roles.items()), roles
    assert "always" in roles["preflight"]
    docs = (REPO / "docs" / "playbooks.md").read_text()
    assert {name for name in roles if f"| `{name}` |" not in docs} == set()
    listed = run("ansible-playbook", "-i", "inventory", "--list-tags", *PLAYBOOKS)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    found = {t.strip() for line in re.findall(r"TASK TAGS: \[(.*)\]", listed.stdout) for t in line.split(",")}
    assert found == set(roles) | {"always"}, found


def test_tags_dataset_runs_the_dataset_role_after_preflight_and_nothing_else() -> None:
    listed = run("ansible-playbook", "-i", "inventory", "provision.yml", "--list-tasks", "--tags", "dataset")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    tasks = [line.strip() for line in listed.stdout.splitlines() if "\tTAGS: [" in line and "play #" not in line]
    # Each role's argument check is tagged always by Ansible itself; every other task is preflight's or dataset's.
    others = [t for t in tasks if "Validating arguments" not in t and "TAGS: [always]" not in t]
    assert others and all("preflight]" in t or "[dataset]" in t for t in others), others
    assert any(t.startswith("xeonsd.cluster.dataset : List the controller's images") for t in others)
    assert any(t.startswith("xeonsd.cluster.verified_tree : Unpack the tree") for t in others)
    assert not any(t.startswith(("ml_stack :", "base_model :", "mpi :")) for t in others)
