"""The commit-message rule (`.ci/commit-subjects`, run by `make lint` over the history and by the commit-msg hook
that `make hooks` installs): a subject of at most 72 characters, a blank line before the body."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / ".ci" / "commit-subjects"


def check(tmp_path: Path, message: str) -> subprocess.CompletedProcess:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    return subprocess.run([sys.executable, str(SCRIPT), "--message", str(path)], capture_output=True, text=True)


def test_a_subject_of_72_characters_with_its_body_after_a_blank_line_passes(tmp_path: Path) -> None:
    ok = check(tmp_path, "x" * 72 + "\n\nThe detail.\n# a comment line git strips, as long as it likes" + "y" * 80)
    assert ok.returncode == 0, ok.stderr


def test_a_long_subject_an_empty_one_and_a_body_without_a_blank_line_are_refused_by_name(tmp_path: Path) -> None:
    long = check(tmp_path, "x" * 73 + "\n")
    assert long.returncode == 1 and "the subject is 73 characters, at most 72" in long.stderr
    empty = check(tmp_path, "# only the comment lines git strips\n")
    assert empty.returncode == 1 and "the subject (first line) is empty" in empty.stderr
    glued = check(tmp_path, "Subject\nbody right under it\n")
    assert glued.returncode == 1 and "the second line is not blank" in glued.stderr


def test_every_commit_since_the_rule_holds_keeps_it() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
