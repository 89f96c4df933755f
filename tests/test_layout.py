"""The code stays in pieces a person can read in one sitting: no Python file over 400 lines and no function over 80,
in the package and the Ansible plugins (plugins/: every custom module, filter, callback, action and module_utils).

The cap is a prompt to look for a seam, not a target: a file near it is usually two concerns."""

from __future__ import annotations

import ast
from pathlib import Path

from repo_code import REPO

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
CHECKED = ("train/src/xeonsd/**/*.py", "plugins/**/*.py")


def python_files() -> list[Path]:
    return sorted({p for pattern in CHECKED for p in REPO.glob(pattern)})


def file_lengths() -> dict[str, int]:
    return {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in python_files()}


def function_lengths() -> dict[str, int]:
    """``path::qualified.name`` (methods and nested functions included) to its lines, ``def`` to end."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, rel: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lengths[f"{rel}::{name}"] = child.end_lineno - child.lineno + 1
                visit(child, rel, f"{name}.")
            else:
                visit(child, rel, prefix)

    for path in python_files():
        rel = str(path.relative_to(REPO))
        visit(ast.parse(path.read_text(), filename=rel), rel, "")
    return lengths


def test_the_checked_trees_hold_python_files() -> None:
    files = file_lengths()
    assert "train/src/xeonsd/cli.py" in files and any(f.startswith("plugins/") for f in files)
    assert any(f.startswith("plugins/module_utils/") for f in files) and any(
        f.startswith("plugins/action/") for f in files
    )


def test_no_file_is_over_400_lines() -> None:
    long = {f: n for f, n in file_lengths().items() if n > MAX_FILE_LINES}
    assert not long, f"split these along a real seam (at most {MAX_FILE_LINES} lines): {long}"


def test_no_function_is_over_80_lines() -> None:
    long = {f: n for f, n in function_lengths().items() if n > MAX_FUNCTION_LINES}
    assert not long, f"split these (at most {MAX_FUNCTION_LINES} lines): {long}"


def test_every_test_module_name_is_unique() -> None:
    """pytest imports each test directory's modules by their bare name (no packages under tests/), so two files of
    one name in two directories fail collection ("import file mismatch") or import each other's helpers; that is
    how CI once lost tests/xeonsd/serve/test_serve.py to tests/cluster/test_serve.py."""
    seen: dict[str, list[str]] = {}
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path.name not in {"conftest.py", "__init__.py"}:
            seen.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"rename one of each: {clashes}"
