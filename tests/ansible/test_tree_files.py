"""roles/verified_tree's filters (plugins/filter/xeonsd_tree.py): a tree named file by file from ansible's find
result, and the difference between a node's tree and the controller's, as the dataset and base_model roles use them."""

from __future__ import annotations

import pytest
from repo_code import ansible_code

xeonsd_tree = ansible_code("xeonsd_tree")


def found(root: str, **checksums: str) -> list[dict]:
    """The `files` of a find with get_checksum (paths are absolute)."""
    return [{"path": f"{root}/{name.replace('__', '/')}", "checksum": c} for name, c in checksums.items()]


def test_the_tree_is_named_by_path_relative_to_its_root_in_sorted_order() -> None:
    tree = xeonsd_tree.tree_files(found("/m/sd", unet__config_json="2", model_index_json="1"), "/m/sd/")
    assert list(tree.items()) == [("model_index_json", "1"), ("unet/config_json", "2")]


def test_excluded_paths_leave_the_tree() -> None:
    files = found("/m", model_index_json="1", _cache="x", unet__w="2") + [{"path": "/m/.cache/hf/a", "checksum": "3"}]
    assert xeonsd_tree.tree_files(files, "/m", exclude=r"(.*/)?\.") == {
        "_cache": "x",
        "model_index_json": "1",
        "unet/w": "2",
    }


def test_a_file_outside_the_root_or_without_a_checksum_is_refused() -> None:
    with pytest.raises(ValueError, match="/elsewhere/a is not under /m"):
        xeonsd_tree.tree_files([{"path": "/elsewhere/a", "checksum": "1"}], "/m")
    with pytest.raises(ValueError, match="get_checksum: true"):
        xeonsd_tree.tree_files([{"path": "/m/a"}], "/m")
    with pytest.raises(TypeError, match="got dict"):
        xeonsd_tree.tree_files({"files": []}, "/m")


def test_the_difference_names_missing_extra_and_changed_files() -> None:
    expected = {"a.jpg": "1", "b.jpg": "2", "metadata.jsonl": "3"}
    assert xeonsd_tree.tree_diff(dict(expected), expected) == ""
    node = {"a.jpg": "1", "b.jpg": "9", "notes.txt": "4"}
    assert xeonsd_tree.tree_diff(node, expected) == "missing: metadata.jsonl; extra: notes.txt; other checksum: b.jpg"


def test_files_are_paired_with_the_sha256_their_name_has_and_an_unknown_name_with_none() -> None:
    pairs = xeonsd_tree.sha256_by_name(["/c/dicoo/1.jpeg", "/c/dicoo/2.jpeg"], {"1.jpeg": "ab" * 32})
    assert pairs == [{"path": "/c/dicoo/1.jpeg", "sha256": "ab" * 32}, {"path": "/c/dicoo/2.jpeg", "sha256": ""}]


def test_under_a_root_a_file_is_paired_by_its_relative_path_so_a_reference_is_not_its_image() -> None:
    by_path = {"p0.png": "ab" * 32, "ref/p0.png": "cd" * 32}
    pairs = xeonsd_tree.sha256_by_name(
        ["/c/pairs/p0.png", "/c/pairs/ref/p0.png", "/c/pairs/ref/p1.png"], by_path, "/c/pairs"
    )
    assert [p["sha256"] for p in pairs] == ["ab" * 32, "cd" * 32, ""]
