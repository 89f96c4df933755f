"""roles/dataset on this machine (ansible-playbook, local connection) with a data set of image pairs, as edit
training reads it (docs/trainer.md#edit-training-on-image-pairs; dataset_recurse, on with finetune_cond_image_column):
the reference images in ref/ are staged and checked with the training images (a damaged one put back, an extra one
named, readable folders), a second run and --check change nothing, dataset_expected_count counts the training images
at the top level only, and dataset_sha256 names a reference by its path."""

from __future__ import annotations

import getpass
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from repo_code import changed, local_playbook

PLAY = """
- hosts: localhost
  gather_facts: false
  roles:
    - role: xeonsd.cluster.dataset
"""


@pytest.fixture
def pairs(tmp_path: Path) -> dict[str, Path]:
    """Two pairs on the "controller": p0.png, p1.png and their references ref/p0.png, ref/p1.png, named in
    metadata.jsonl."""
    src = tmp_path / "controller"
    (src / "ref").mkdir(parents=True)
    rows = []
    for i in range(2):
        (src / f"p{i}.png").write_bytes(f"edited {i}".encode())
        (src / "ref" / f"p{i}.png").write_bytes(f"reference {i}".encode())
        rows.append({"file_name": f"p{i}.png", "text": "make it blue", "cond_image": f"ref/p{i}.png"})
    (src / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "cache").mkdir()
    (tmp_path / "play.yml").write_text(PLAY)
    return {"src": src, "dest": tmp_path / "node", "cache": tmp_path / "cache", "play": tmp_path / "play.yml"}


def play(pairs: dict[str, Path], *args: str, **extra: object) -> subprocess.CompletedProcess:
    variables = {
        "dataset_source_dir": str(pairs["src"]),
        "dataset_dir": str(pairs["dest"]),
        "dataset_owner": getpass.getuser(),
        "dataset_expected_count": 2,
        "controller_cache_dir": str(pairs["cache"]),
        "finetune_cond_image_column": "cond_image",
        "ansible_python_interpreter": sys.executable,
        **extra,
    }
    return local_playbook(pairs["play"], variables, *args)


def test_the_reference_images_are_staged_and_checked_with_the_training_images(pairs: dict[str, Path]) -> None:
    assert changed(play(pairs)) == 4  # packed and named, directory made, unpacked
    node = pairs["dest"]
    staged = sorted(str(p.relative_to(node)) for p in node.rglob("*") if p.is_file())
    assert staged == ["metadata.jsonl", "p0.png", "p1.png", "ref/p0.png", "ref/p1.png"], staged
    # The job's account reads them: ref/ searchable (unarchive gives a top folder the files' mode), images not
    # executable.
    modes = {p: oct((node / p).stat().st_mode & 0o777) for p in ("ref", "ref/p0.png", "p0.png")}
    assert modes == {"ref": "0o755", "ref/p0.png": "0o644", "p0.png": "0o644"}, modes
    assert changed(play(pairs)) == 0
    (node / "ref" / "p1.png").write_bytes(b"damaged")
    assert changed(play(pairs, "--check")) == 0
    assert changed(play(pairs)) == 1
    assert (node / "ref" / "p1.png").read_bytes() == b"reference 1"
    (node / "ref" / "extra.png").write_bytes(b"left over")
    result = play(pairs)
    assert result.returncode != 0
    assert f"localhost: {node} differs from the controller's images and captions (extra: ref/extra.png;" in (
        result.stdout
    )


def test_only_the_top_level_images_count_and_dataset_sha256_names_a_reference_by_its_path(
    pairs: dict[str, Path],
) -> None:
    result = play(pairs, "--check", dataset_expected_count=4)
    assert result.returncode != 0
    assert (
        "has 2 images at the top level, 4 expected (2 more in subfolders, reference images, are not counted)"
        in result.stdout
    )
    sha = {
        str(p.relative_to(pairs["src"])): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in pairs["src"].rglob("*.png")
    }
    # a fresh node: would pack and name the tar, make the directory
    assert changed(play(pairs, "--check", dataset_sha256=sha)) == 3
    sha["ref/p0.png"] = sha["p0.png"]
    wrong = play(pairs, "--check", dataset_sha256=sha)
    assert wrong.returncode != 0 and f"{pairs['src'] / 'ref' / 'p0.png'} (image) on the controller" in wrong.stdout


def test_masks_under_the_dataset_dir_are_staged_with_the_images(tmp_path: Path) -> None:
    """The masked loss's masks in a masks/ subfolder, finetune_masks naming it under dataset_dir and no image pairs:
    dataset_recurse's default stages them with the images (checked as they are: the pairs test above); named
    elsewhere, the subfolder stays behind."""
    src = tmp_path / "controller"
    (src / "masks").mkdir(parents=True)
    for i in range(2):
        (src / f"p{i}.png").write_bytes(f"image {i}".encode())
        (src / "masks" / f"p{i}.png").write_bytes(f"mask {i}".encode())
    (tmp_path / "cache").mkdir()
    (tmp_path / "play.yml").write_text(PLAY)
    site = {"src": src, "cache": tmp_path / "cache", "play": tmp_path / "play.yml"}
    for node, masks, expected in (
        (tmp_path / "node", "{{ dataset_dir }}/masks", ["masks/p0.png", "masks/p1.png", "p0.png", "p1.png"]),
        (tmp_path / "other", str(tmp_path / "elsewhere"), ["p0.png", "p1.png"]),
    ):
        result = play(site | {"dest": node}, finetune_cond_image_column="", finetune_masks=masks)
        assert result.returncode == 0, result.stdout[-3000:]
        staged = sorted(str(p.relative_to(node)) for p in node.rglob("*") if p.is_file())
        assert staged == expected, (masks, staged)
