"""roles/verified_tree on this machine (ansible-playbook, local connection): a tree from a "controller" directory is
unpacked into a "node" directory, a second run changes nothing, a damaged file is put back, and a node whose copy
stays wrong fails with the files that differ."""

from __future__ import annotations

import getpass
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from repo_code import REPO, VENV_BIN

PLAY = """
- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.find: {paths: "{{ src }}", recurse: true, get_checksum: true}
      register: controller
    - ansible.builtin.import_role:
        name: verified_tree
      vars:
        verified_tree_src: "{{ src }}"
        verified_tree_files: "{{ controller.files | xeonsd_tree_files(src, exclude='(.*/)?\\\\.') }}"
        verified_tree_dest: "{{ dest }}"
        verified_tree_owner: "{{ owner }}"
        verified_tree_recurse: true
        verified_tree_what: model
        verified_tree_name: test-tree
        verified_tree_cache_dir: "{{ cache }}"
"""


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    src = tmp_path / "controller"
    (src / "unet").mkdir(parents=True)
    (src / "model_index.json").write_text("{}")
    (src / "unet" / "config.json").write_text('{"a": 1}')
    (src / ".cache").mkdir()
    (src / ".cache" / "download.lock").write_text("not part of the model")
    (tmp_path / "cache").mkdir()
    (tmp_path / "play.yml").write_text(PLAY)
    return {"src": src, "dest": tmp_path / "node", "cache": tmp_path / "cache", "play": tmp_path / "play.yml"}


def play(tree: dict[str, Path], *args: str) -> subprocess.CompletedProcess:
    extra = {
        "src": str(tree["src"]),
        "dest": str(tree["dest"]),
        "cache": str(tree["cache"]),
        "owner": getpass.getuser(),
        "ansible_python_interpreter": sys.executable,
    }
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_ROLES_PATH=str(REPO / "roles"),
               ANSIBLE_FILTER_PLUGINS=str(REPO / "plugins" / "filter"),
               ANSIBLE_LOCALHOST_WARNING="false", ANSIBLE_INVENTORY_UNPARSED_WARNING="false", NO_COLOR="1")  # fmt: skip
    return subprocess.run(
        [str(VENV_BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", "-e", json.dumps(extra),
         str(tree["play"]), *args],
        cwd=REPO, env=env, text=True, capture_output=True, timeout=300,
    )  # fmt: skip


def changed(result: subprocess.CompletedProcess) -> int:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (recap,) = [line for line in result.stdout.splitlines() if line.startswith("localhost ") and "changed=" in line]
    return int(recap.split("changed=")[1].split()[0])


def test_the_tree_is_copied_once_left_alone_repaired_and_a_wrong_copy_is_named(tree: dict[str, Path]) -> None:
    assert changed(play(tree)) == 3  # packed, directory made, unpacked
    node = tree["dest"]
    assert (node / "unet" / "config.json").read_text() == '{"a": 1}' and not (node / ".cache").exists()
    assert [p.name for p in tree["cache"].iterdir()][0].startswith("test-tree-")
    assert changed(play(tree)) == 0
    (node / "unet" / "config.json").write_text("damaged")
    assert changed(play(tree, "--check")) == 0  # unarchive (gtar) has no check mode: it reports nothing
    assert changed(play(tree)) == 1
    assert (node / "unet" / "config.json").read_text() == '{"a": 1}'
    # A file the tar does not overwrite: the node's copy stays wrong, and the run says which file and what to do.
    (node / "unet" / "extra.bin").write_text("left over")
    result = play(tree)
    assert result.returncode != 0
    assert (f"localhost: {node} differs from the controller's model (extra: unet/extra.bin; 3 files, 2 expected). "
            f"Fix: remove {node} and re-run with --limit localhost.") in result.stdout  # fmt: skip
