"""A directory tree as ``{relative path: checksum}``, and what differs between two of them.

roles/verified_tree puts one tree from the controller on every node (the dataset, base_model and wheelhouse roles
use it): the controller's tree and each node's are listed with ``ansible.builtin.find`` (``get_checksum: true``)
and compared with these filters. ``xeonsd_sha256_by_name`` pairs files with their expected sha256 by name or
relative path (the dataset's images with dataset_sha256) for the xeonsd_sha256 module (plugins/modules/xeonsd_sha256.py).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Any


def tree_files(files: Sequence[Mapping[str, Any]], root: str, exclude: str = "") -> dict[str, str]:
    """``find``'s ``files`` under ``root`` → ``{path relative to root: checksum}``, sorted by path; paths that
    match the regular expression ``exclude`` (from their start) are left out."""
    if isinstance(files, (str, Mapping)) or not isinstance(files, Sequence):
        raise TypeError(f"xeonsd_tree_files: expected the 'files' list of a find result, got {type(files).__name__}")
    skip = re.compile(exclude) if exclude else None
    tree = {}
    for f in files:
        if "checksum" not in f:
            raise ValueError(f"xeonsd_tree_files: {f.get('path', f)} has no checksum (find needs get_checksum: true)")
        rel = posixpath.relpath(f["path"], root)
        if rel.startswith("../"):
            raise ValueError(f"xeonsd_tree_files: {f['path']} is not under {root}")
        if skip is None or not skip.match(rel):
            tree[rel] = f["checksum"]
    return dict(sorted(tree.items()))


def tree_diff(found: Mapping[str, str], expected: Mapping[str, str]) -> str:
    """Empty when ``found`` equals ``expected``; else which files are missing, extra or have another checksum."""
    parts = [
        (what, names)
        for what, names in (
            ("missing", sorted(set(expected) - set(found))),
            ("extra", sorted(set(found) - set(expected))),
            ("other checksum", sorted(k for k in set(found) & set(expected) if found[k] != expected[k])),
        )
        if names
    ]
    return "; ".join(f"{what}: {', '.join(names)}" for what, names in parts)


def sha256_by_name(paths: Sequence[str], by_name: Mapping[str, str], root: str = "") -> list[dict[str, str]]:
    """Files and the sha256 that ``by_name`` gives their names, as the xeonsd_sha256 module takes them:
    ``[{"path", "sha256"}, …]`` ("" where it has none). A name is the file's name, or with ``root`` its path
    relative to ``root`` (dataset_sha256: ``p0.png`` at the top level, ``ref/p0.png`` in a subfolder)."""
    return [
        {"path": p, "sha256": by_name.get(posixpath.relpath(p, root) if root else posixpath.basename(p), "")}
        for p in paths
    ]


class FilterModule:
    def filters(self) -> dict:
        return {"xeonsd_tree_files": tree_files, "xeonsd_tree_diff": tree_diff, "xeonsd_sha256_by_name": sha256_by_name}
