"""roles/verified_tree on this machine (ansible-playbook, local connection): a tree from a "controller" directory is
unpacked into a "node" directory, a second run changes nothing, a damaged file is put back, and a node whose copy
stays wrong fails with the files that differ; the wheelhouse role, built from a local index, is delivered the same
way; and the xeonsd_sha256 module names a staged file that is missing or differs."""

from __future__ import annotations

import getpass
import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from repo_code import changed, local_playbook

PLAY = """
- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.find: {paths: "{{ src }}", recurse: true, get_checksum: true}
      register: controller
    - ansible.builtin.import_role:
        name: xeonsd.cluster.verified_tree
      vars:
        verified_tree_src: "{{ src }}"
        verified_tree_files: "{{ controller.files | xeonsd.cluster.xeonsd_tree_files(src, exclude='(.*/)?\\\\.') }}"
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
    extra = {k: str(tree[k]) for k in ("src", "dest", "cache") if k in tree}
    extra |= {"owner": getpass.getuser(), "ansible_python_interpreter": sys.executable}
    return local_playbook(tree["play"], extra, *args)


def test_the_tree_is_copied_once_left_alone_repaired_and_a_wrong_copy_is_named(tree: dict[str, Path]) -> None:
    assert changed(play(tree)) == 4  # packed and named, directory made, unpacked
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
    assert (
        f"localhost: {node} differs from the controller's model (extra: unet/extra.bin; 3 files, 2 expected). "
        f"Fix: remove {node} and re-run with --limit localhost."
    ) in result.stdout


def test_a_shared_tree_is_written_by_the_primary_only_and_checked_by_every_node(
    tree: dict[str, Path], tmp_path: Path
) -> None:
    # Two "nodes" on this machine, both seeing the same directory: a shared home. node1 is the primary.
    (tmp_path / "hosts.ini").write_text(
        "[primary]\nnode1 ansible_connection=local\n[workers]\nnode2 ansible_connection=local\n"
        "[cluster:children]\nprimary\nworkers\n"
    )
    tree["play"].write_text(tree["play"].read_text().replace("hosts: localhost", "hosts: cluster"))
    shared = ("-i", str(tmp_path / "hosts.ini"), "-e", "verified_tree_write_once=true")

    def recap(result: subprocess.CompletedProcess) -> dict[str, str]:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        lines = [line.split(None, 2) for line in result.stdout.splitlines() if " : ok=" in line]
        return {host: rest.split("changed=")[1].split()[0] for host, _, rest in lines}

    first = play(tree, *shared)
    assert recap(first) == {"node1": "4", "node2": "0"}  # packed and named, directory made, unpacked: by node1 alone
    assert "skipping: [node2]" in first.stdout and (tree["dest"] / "unet" / "config.json").read_text() == '{"a": 1}'
    assert recap(play(tree, *shared)) == {"node1": "0", "node2": "0"}
    # node2 alone (--limit) never writes the shared copy: a damaged file fails there, naming the node that writes it.
    (tree["dest"] / "unet" / "config.json").write_text("damaged")
    result = play(tree, *shared, "--limit", "node2")
    assert result.returncode != 0 and (tree["dest"] / "unet" / "config.json").read_text() == "damaged"
    assert "re-run with --limit node1,node2 (the shared copy is written by node1)" in result.stdout
    assert recap(play(tree, *shared)) == {"node1": "1", "node2": "0"}  # the primary repairs it, node2 checks it


SHA256_PLAY = """
- hosts: localhost
  gather_facts: false
  tasks:
    - name: Check the staged files
      xeonsd.cluster.xeonsd_sha256:
        files: "{{ files }}"
        what: staged file
        where: the controller
        says: staged_sha256
"""


def test_files_are_checked_against_their_sha256_and_a_wrong_or_missing_one_is_named(tmp_path: Path) -> None:
    """plugins/modules/xeonsd_sha256.py, as preflight, python_env, ml_stack and dataset run it."""
    staged = tmp_path / "installer.sh"
    staged.write_bytes(b"#!/bin/sh\n")
    good = hashlib.sha256(staged.read_bytes()).hexdigest()
    (tmp_path / "play.yml").write_text(SHA256_PLAY)
    tree = {"play": tmp_path / "play.yml"}

    def check(*files: dict, mode: str = "") -> subprocess.CompletedProcess:
        return play(tree, "-e", json.dumps({"files": list(files)}), *([mode] if mode else []))

    assert changed(check({"path": str(staged), "sha256": good})) == 0
    assert changed(check({"path": str(staged), "sha256": good}, mode="--check")) == 0
    wrong = check({"path": str(staged), "sha256": "0" * 64, "fix": "stage it again"})
    assert wrong.returncode != 0
    assert (
        f"{staged} (staged file) on the controller has sha256 {good}; staged_sha256 says {'0' * 64}. "
        "Fix: stage it again."
    ) in wrong.stdout
    missing = check({"path": str(tmp_path / "nowhere"), "sha256": good, "what": "archive", "says": "archive_sha256"})
    assert missing.returncode != 0
    assert (
        f"{tmp_path / 'nowhere'} (archive) does not exist on the controller; archive_sha256 says {good}. "
        "Fix: stage the right file there."
    ) in missing.stdout
    unknown = check({"path": str(staged), "sha256": ""}, {"path": str(tmp_path), "sha256": good})
    assert unknown.returncode != 0 and "staged_sha256 says nothing for this file" in unknown.stdout
    assert f"{tmp_path} (staged file) on the controller has sha256 none (not a regular file)" in unknown.stdout


WHEELHOUSE_PLAY = """
- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.include_role:
        name: xeonsd.cluster.wheelhouse
      vars:
        wheelhouse_downloads: [["--no-deps", "--no-index", "--find-links", "{{ index }}", "-r", "{{ pins }}"]]
        wheelhouse_inputs: ["{{ pins }}"]
        wheelhouse_python: "{{ ansible_python_interpreter }}"
        wheelhouse_controller_dir: "{{ cache }}/wheelhouse"
        wheelhouse_node_dir: "{{ dest }}"
        wheelhouse_owner: "{{ owner }}"
    - ansible.builtin.copy:
        dest: "{{ cache }}/wheelhouse_path"
        content: "{{ wheelhouse_path }}"
        mode: "0644"
      check_mode: false
      changed_when: false
"""


def wheel(index: Path, name: str, version: str) -> Path:
    """A minimal, valid pure-Python wheel in ``index``."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": "",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    index.mkdir(exist_ok=True)
    path = index / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for arcname, text in files.items():
            z.writestr(arcname, text)
        z.writestr(f"{dist}/RECORD", "".join(f"{a},,\n" for a in files) + f"{dist}/RECORD,,\n")
    return path


def test_the_wheelhouse_is_built_once_and_delivered_by_verified_tree(tmp_path: Path) -> None:
    index, cache, dest = tmp_path / "index", tmp_path / "cache", tmp_path / "node"
    wheel(index, "tinypkg", "1.0")
    cache.mkdir()
    pins = tmp_path / "requirements.txt"
    pins.write_text("tinypkg==1.0\n")
    (tmp_path / "play.yml").write_text(WHEELHOUSE_PLAY)
    tree = {"src": tmp_path, "dest": dest, "cache": cache, "play": tmp_path / "play.yml"}
    extra = ("-e", json.dumps({"index": str(index), "pins": str(pins)}))

    assert changed(play(tree, *extra)) > 0
    path = Path((cache / "wheelhouse_path").read_text())
    assert path.parent == dest and sorted(p.name for p in path.iterdir()) == ["tinypkg-1.0-py3-none-any.whl"]
    # One controller tree (marked complete) and the tar verified_tree packed from it, named after its content.
    (built,) = [p for p in (cache / "wheelhouse").iterdir() if p.is_dir()]
    assert built.name == path.name and (built / ".complete").exists()
    (packed,) = (cache / "wheelhouse").glob("wheelhouse-*.tar")
    assert changed(play(tree, *extra)) == 0
    assert changed(play(tree, *extra, "--check")) == 0
    # A damaged wheel on the node is put back from the same tar; nothing is downloaded again.
    (path / "tinypkg-1.0-py3-none-any.whl").write_bytes(b"damaged")
    for whl in index.iterdir():
        whl.unlink()
    assert changed(play(tree, *extra)) == 1
    assert (path / "tinypkg-1.0-py3-none-any.whl").read_bytes()[:2] == b"PK"
    assert list((cache / "wheelhouse").glob("wheelhouse-*.tar")) == [packed]


def test_a_wheelhouse_packed_by_the_earlier_role_is_reused_not_downloaded(tmp_path: Path) -> None:
    """Before verified_tree delivered it, the role kept only <controller dir>/wheelhouse-<id>.tar (wheelhouse/
    inside) and nodes a flat <node dir>/<id>: both are taken as they are."""
    index, cache, dest = tmp_path / "index", tmp_path / "cache", tmp_path / "node"
    whl = wheel(tmp_path / "old", "tinypkg", "1.0")
    cache.mkdir()
    pins = tmp_path / "requirements.txt"
    pins.write_text("tinypkg==1.0\n")
    (tmp_path / "play.yml").write_text(WHEELHOUSE_PLAY)
    tree = {"src": tmp_path, "dest": dest, "cache": cache, "play": tmp_path / "play.yml"}
    extra = ("-e", json.dumps({"index": str(index), "pins": str(pins)}))
    # The wheelhouse's id, as the role names it: first run against an empty index fails in pip download.
    index.mkdir()
    assert play(tree, *extra).returncode != 0
    (partial,) = (cache / "wheelhouse").iterdir()
    wid = partial.name.removesuffix(".partial")
    shutil.rmtree(partial)
    (tmp_path / "wheelhouse").mkdir()
    shutil.copy(whl, tmp_path / "wheelhouse")
    subprocess.run(
        ["tar", "-C", str(tmp_path), "-cf", str(cache / "wheelhouse" / f"wheelhouse-{wid}.tar"), "wheelhouse"],
        check=True,
    )
    (dest / wid).mkdir(parents=True)
    shutil.copy(whl, dest / wid)
    (dest / wid / ".complete").write_text(wid + "\n")

    result = play(tree, *extra)
    assert changed(result) > 0  # the index is empty: a pip download would have failed the run
    download = result.stdout.split("xeonsd.cluster.wheelhouse : Download the wheels]")[1].split("TASK [")[0]
    assert "skipping:" in download and "changed:" not in download, download
    assert (cache / "wheelhouse" / wid / whl.name).read_bytes() == whl.read_bytes()
    # The node's copy already has these files: it is left as it is.
    unpack = result.stdout.split("Unpack the tree where the node's files differ")[1].split("TASK [")[0]
    assert "skipping:" in unpack and "changed:" not in unpack, unpack
    assert changed(play(tree, *extra)) == 0
