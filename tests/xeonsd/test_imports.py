"""The package's layering, as each subpackage's ``__init__`` states it: what a part may import.

Every ``xeonsd`` import is read from the source (module level and inside functions alike), so a shortcut from
the trainer into the OpenVINO side, or from the cluster code into the trainer, fails here with the line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from repo_code import REPO

PKG = REPO / "train" / "src" / "xeonsd"
TOP = {p.stem for p in PKG.glob("*.py")} - {"__init__", "cli"}
SUBPACKAGES = sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").is_file())
# part -> the parts it may import besides itself and the top-level modules (None: anything).
ALLOWED: dict[str, set[str] | None] = {
    "top": set(),
    "contracts": set(),
    "modelfiles": set(),
    "cluster": {"contracts"},
    "trainer": {"cluster", "contracts", "modelfiles"},
    "openvino": {"contracts", "modelfiles"},
    "ops": {"trainer", "cluster", "contracts", "modelfiles"},
    "assets": set(),
    "bench": None,
    "cli": None,
}


def _part(module: str) -> str:
    """'xeonsd.trainer.loop' -> 'trainer'; 'xeonsd.fsutil' -> 'top'."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in TOP:
        return "top"
    return parts[1]


def _module_of(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    return ".".join(p for p in rel.parts if p != "__init__")


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "xeonsd" or (PKG.parent / node.module.replace(".", "/") / "__init__.py").is_file():
                out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
            elif node.module.startswith("xeonsd."):
                out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("xeonsd.")]
    return out


def _allowed(src: str, dst: str) -> bool:
    src_part = "cli" if src == "xeonsd.cli" else _part(src)
    dst_part = _part(dst)
    rule = ALLOWED[src_part]
    if rule is None or dst_part in ("top", src_part):
        return True
    return any(dst == f"xeonsd.{r}" or dst.startswith(f"xeonsd.{r}.") or dst_part == r for r in rule)


def test_the_parts_are_the_ones_the_rules_name() -> None:
    assert set(SUBPACKAGES) == set(ALLOWED) - {"top", "cli"}


@pytest.mark.parametrize("part", ["top", *SUBPACKAGES])
def test_each_part_imports_only_what_its_docstring_allows(part: str) -> None:
    files = PKG.glob("*.py") if part == "top" else (PKG / part).rglob("*.py")
    bad = []
    for path in sorted(files):
        src = _module_of(path)
        for line, dst in _imports(path):
            if not _allowed(src, dst):
                bad.append(f"{path.relative_to(REPO)}:{line}: {src} imports {dst}")
    assert not bad, "\n".join(bad)


def test_a_forbidden_import_is_caught(tmp_path: Path) -> None:
    """The checker itself: the trainer reaching into the OpenVINO side is refused, and so is the other way round."""
    assert not _allowed("xeonsd.trainer.loop", "xeonsd.openvino.export")
    assert not _allowed("xeonsd.cluster.hello", "xeonsd.trainer.config")
    assert not _allowed("xeonsd.openvino.export", "xeonsd.trainer.models")
    assert not _allowed("xeonsd.openvino.quantize", "xeonsd.trainer.prompts")
    assert _allowed("xeonsd.openvino.export", "xeonsd.modelfiles.families")
    assert _allowed("xeonsd.trainer.loop", "xeonsd.fsutil")
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from xeonsd.openvino import export\n")
    assert _imports(bad) == [(2, "xeonsd.openvino.export")]
