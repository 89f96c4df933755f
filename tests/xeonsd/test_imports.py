"""The package's layering, as each subpackage's ``__init__`` states it: what a part may import; the trainer's own
layers (``xeonsd/trainer/__init__.py``); and no import cycle anywhere in the package.

Every ``xeonsd`` import is read from the source (module level and inside functions alike: a lazy import is an
import), so a shortcut from the trainer into the OpenVINO side, from the cluster code into the trainer, or from a
trainer layer into one above it fails here with the line. Imports under ``if TYPE_CHECKING:`` are left out: they
never run, they name types."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
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
    "jobs": {"contracts"},
    "modelfiles": {"families"},
    "cluster": {"contracts"},
    # a family's folder: its spec (standard library) and its training side, on the trainer's parts
    "families": {"trainer", "cluster", "contracts", "jobs", "modelfiles", "assets"},
    "trainer": {"cluster", "contracts", "jobs", "modelfiles", "families"},
    # generate hands a pipeline directory to the PyTorch engine, which has the OpenVINO engines' interface
    "openvino": {"contracts", "modelfiles", "families", "torch_engine"},
    "torch_engine": {"openvino", "modelfiles", "families"},
    "ops": {"trainer", "cluster", "contracts", "jobs", "modelfiles", "families"},
    "serve": {"openvino", "torch_engine", "contracts", "modelfiles", "families"},
    "assets": {"families"},
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


def _type_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:``."""
    nodes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            nodes |= {id(x) for stmt in node.body for x in ast.walk(stmt)}
    return nodes


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    tree = ast.parse(path.read_text(), str(path))
    type_only = _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
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
    assert not _allowed("xeonsd.openvino.quantize", "xeonsd.trainer.prompt_tables")
    assert _allowed("xeonsd.openvino.export", "xeonsd.families")
    assert _allowed("xeonsd.trainer.loop", "xeonsd.fsutil")
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from xeonsd.openvino import export\n")
    assert _imports(bad) == [(2, "xeonsd.openvino.export")]


# The parts the playbooks run without torch: the filter plugins import xeonsd.contracts on the controller from the
# source tree, and the finetune role runs xeonsd.jobs's commands (`xeonsd jobstatus` ...) on every node.
STDLIB_ONLY = ("contracts", "jobs")


def _foreign_imports(path: Path, part: str) -> list[str]:
    """The imports of ``path`` (lazy ones too) that are neither the standard library nor the parts ``part`` may
    import: a top-level xeonsd module may pull in anything, so only the stdlib-only parts themselves count."""
    allowed = {part, *(ALLOWED[part] or ())}
    where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            top, _, rest = name.partition(".")
            ok = top in sys.stdlib_module_names or (top == "xeonsd" and rest.split(".")[0] in allowed)
            if not ok:
                bad.append(f"{where}:{node.lineno}: imports {name}")
    return bad


@pytest.mark.parametrize("part", STDLIB_ONLY)
def test_the_parts_the_playbooks_run_import_only_the_standard_library(part: str) -> None:
    assert ALLOWED[part] is not None and ALLOWED[part] <= set(STDLIB_ONLY)
    bad = [b for path in sorted((PKG / part).rglob("*.py")) for b in _foreign_imports(path, part)]
    assert not bad, "standard library only (the playbooks import these without torch):\n" + "\n".join(bad)
    # And at run time: every module imports in an interpreter that has only the standard library and train/src.
    modules = [_module_of(p) for p in sorted((PKG / part).rglob("*.py"))]
    code = (
        "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)\n"
        "print(sorted({n.split('.')[0] for n in sys.modules} - set(sys.stdlib_module_names) - {'__main__'}))"
    )
    env = {"PYTHONPATH": str(PKG.parent), "PATH": os.environ.get("PATH", "")}
    out = subprocess.run([sys.executable, "-S", "-c", code, *modules], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['xeonsd']"


def test_the_standard_library_check_catches_a_third_party_import(tmp_path: Path) -> None:
    lazy = tmp_path / "m.py"
    lazy.write_text("import json\nfrom xeonsd.contracts import job_status\ndef f():\n    import torch\n")
    assert _foreign_imports(lazy, "jobs") == [f"{lazy}:4: imports torch"]
    lazy.write_text("from xeonsd.fsutil import atomic_write\nfrom xeonsd.jobs import watch\n")
    assert _foreign_imports(lazy, "contracts") == [f"{lazy}:1: imports xeonsd.fsutil", f"{lazy}:2: imports xeonsd.jobs"]


# The trainer's layers, lowest first: a module imports only from its own layer and those below it (and, with no
# cycle, never back). xeonsd/trainer/__init__.py says what each layer is.
TRAINER_LAYERS: list[set[str]] = [
    {
        "config",
        "argv",
        "attention",
        "resolution",
        "rng",
        "rank_io",
        "checkpoint",
        "metrics",
        "tracking",
        "weights",
        "shared_weights",
        "sharding",
        "libraries",
        "embeddings",
        "loss",
        "flow",
        "stopping",
    },
    {
        "data",
        "buckets",
        "masks",
        "captions",
        "prompt_tables",
        "models",
        "pipelines",
        "conditioning",
        "latents",
        "prior",
        "methods",
        "optim",
    },
    {"step"},
    {"inputs", "memory", "validation", "encoded_prompts", "job"},
    {"after_step", "summary"},
    {"loop"},
]


def _trainer_module(module: str) -> str | None:
    """'xeonsd.trainer.methods.lora' -> 'methods'; None outside the trainer (or the package itself)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "trainer" else None


def _layer(name: str) -> int:
    return next(i for i, layer in enumerate(TRAINER_LAYERS) if name in layer)


def _graph() -> dict[str, set[str]]:
    """Every module of the package to the package modules it imports (a name imported from a package that is a
    module of it counts as that module)."""
    graph: dict[str, set[str]] = {}
    modules = {_module_of(p) for p in PKG.rglob("*.py")}
    for path in sorted(PKG.rglob("*.py")):
        src = _module_of(path)
        deps = set()
        for _, dst in _imports(path):
            while dst not in modules and "." in dst:
                dst = dst.rsplit(".", 1)[0]
            if dst in modules and dst != src:
                deps.add(dst)
        graph[src] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (lazy imports included): " + "; ".join(" <-> ".join(c) for c in cycles)


def test_every_trainer_module_has_a_layer() -> None:
    names = {n for m in _graph() if (n := _trainer_module(m))}
    assert names == set().union(*TRAINER_LAYERS), "give each trainer module one layer (and drop gone ones)"


def test_each_trainer_layer_imports_only_its_own_and_those_below() -> None:
    bad = []
    for path in sorted((PKG / "trainer").rglob("*.py")):
        src = _trainer_module(_module_of(path))
        if src is None:
            continue
        for line, dst in _imports(path):
            name = _trainer_module(dst)
            if name is not None and _layer(name) > _layer(src):
                bad.append(
                    f"{path.relative_to(REPO)}:{line}: {src} (layer {_layer(src) + 1}) imports {name} "
                    f"(layer {_layer(name) + 1})"
                )
    assert not bad, "\n".join(bad)


def test_the_checkers_catch_a_cycle_and_an_upward_import(tmp_path: Path) -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert _layer("loop") > _layer("after_step") > _layer("step") > _layer("data") > _layer("config")
    lazy = tmp_path / "m.py"
    lazy.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from xeonsd.trainer import job\n"
        "def f():\n    from xeonsd.trainer.loop import fit\n"
    )
    assert _imports(lazy) == [(5, "xeonsd.trainer.loop")]  # the lazy import counts, the type-only one does not


def test_the_package_overview_names_every_subpackage_and_top_level_module() -> None:
    """xeonsd/__init__.py's docstring is the map of the package: each subpackage and top-level module is on it."""
    import xeonsd

    root = Path(xeonsd.__file__).parent
    names = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    names |= {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    doc = xeonsd.__doc__ or ""
    missing = sorted(n for n in names if f":mod:`xeonsd.{n}`" not in doc and f":mod:`~xeonsd.{n}`" not in doc)
    assert missing == [], f"add them to the overview in xeonsd/__init__.py: {missing}"
