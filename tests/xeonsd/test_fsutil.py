"""Crash-safe output: a write that fails leaves the old file as it was and no temporary file beside it."""

from __future__ import annotations

import os

import pytest

from xeonsd.fsutil import atomic_file, atomic_path


@pytest.mark.parametrize("writer", ["file", "path"])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, writer):
    target = tmp_path / "sub" / "out.json"
    target.parent.mkdir()
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_file(target, "w") if writer == "file" else atomic_path(target) as out:
        if writer == "file":
            out.write("half")
        else:
            out.write_text("half")
        raise RuntimeError("the writer failed")
    assert target.read_text() == "old"
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.json"]


def test_a_whole_write_replaces_the_file_with_the_umask_mode(tmp_path):
    target = tmp_path / "new" / "out.txt"  # the directory is made
    with atomic_file(target, "w") as fh:
        fh.write("new")
    assert target.read_text() == "new"
    mask = os.umask(0)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~mask
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.txt"]
