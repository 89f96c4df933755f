"""The collection xeonsd.cluster as a user gets it: built with ``ansible-galaxy collection build`` from this
repository, installed with ``ansible-galaxy collection install`` into a directory of its own, and Ansible run
outside the repository (no ansible.cfg of ours) with that directory as its collections path. Shared by
tests/ansible/test_collection.py and the test cluster's tests/cluster/test_collection_role.py."""

from __future__ import annotations

import os
import re
import subprocess
import tarfile
from pathlib import Path

from repo_code import REPO, VENV_BIN

NAME = "xeonsd.cluster"


def galaxy(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(VENV_BIN / "ansible-galaxy"), "collection", *argv],
        cwd=cwd,
        env=user_env(),
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def user_env(collections: Path | None = None) -> dict[str, str]:
    """Ansible's environment on a user's controller: none of this repository's configuration, the collections
    where ``collections`` says (their ansible_collections/ folder's parent)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_NOCOLOR="1", NO_COLOR="1", ANSIBLE_LOCALHOST_WARNING="false")
    if collections is not None:
        env["ANSIBLE_COLLECTIONS_PATH"] = str(collections)
    return env


def build(out: Path) -> Path:
    """``ansible-galaxy collection build`` in the repository root: the archive."""
    galaxy("build", "--output-path", str(out), cwd=REPO)
    (archive,) = out.glob("xeonsd-cluster-*.tar.gz")
    return archive


def install(archive: Path, into: Path) -> Path:
    """``ansible-galaxy collection install`` of the archive into ``into``; returns the installed collection's
    directory (into/ansible_collections/xeonsd/cluster)."""
    galaxy("install", str(archive), "-p", str(into), cwd=into.parent)
    return into / "ansible_collections" / "xeonsd" / "cluster"


def members(archive: Path) -> list[str]:
    with tarfile.open(archive) as tar:
        return tar.getnames()


def docs_example() -> str:
    """The playbook of docs/collection.md's "One role in your own playbook": the first YAML block under it."""
    text = (REPO / "docs" / "collection.md").read_text()
    section = text.split("## One role in your own playbook", 1)[1]
    match = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert match, "docs/collection.md: no yaml block under 'One role in your own playbook'"
    return match[1]
