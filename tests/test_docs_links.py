"""The README is a map: every relative link in it, in docs/ and in the roles' READMEs leads to a file that exists,
and a link to a #section leads to a heading of that file (GitHub's anchor rules)."""

from __future__ import annotations

import re
from pathlib import Path

from repo_code import REPO

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted(REPO.glob("roles/*/README.md"))]


def _prose_lines(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """The #anchors GitHub gives the file's headings: lower case, punctuation dropped, spaces to hyphens."""
    found: set[str] = set()
    for line in _prose_lines(path):
        m = _HEADING.match(line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m[1].lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in found:
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for line in _prose_lines(path):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: …
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                broken.append(f"{target} (no such file)")
            elif anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{target} (no such heading in {dest.relative_to(REPO)})")
    return broken


def test_every_relative_link_in_the_docs_leads_somewhere() -> None:
    problems = {str(p.relative_to(REPO)): broken_links(p) for p in markdown_files()}
    assert {name: links for name, links in problems.items() if links} == {}


def test_every_doc_is_linked_from_the_readme() -> None:
    readme = (REPO / "README.md").read_text()
    unlinked = [p.name for p in sorted((REPO / "docs").glob("*.md")) if f"](docs/{p.name}" not in readme]
    assert unlinked == []


def test_every_dated_benchmark_file_is_linked_from_the_benchmarks_page() -> None:
    page = (REPO / "docs" / "benchmarks.md").read_text()
    dated = sorted((REPO / "docs" / "benchmarks").glob("*.md"))
    assert dated, "docs/benchmarks/ holds the dated runs"
    assert [p.name for p in dated if f"](benchmarks/{p.name}" not in page] == []
    assert [p.name for p in dated if not re.match(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md$", p.name)] == []


def test_the_docs_cite_no_issue_numbers() -> None:
    """The repository has no issue tracker: a doc says what the change was, not "issue 36"."""
    cited = {
        str(p.relative_to(REPO)): hits
        for p in markdown_files()
        if (hits := re.findall(r"\bissues? #?\d+|\bissue-\d+", p.read_text(), re.IGNORECASE))
    }
    assert cited == {}


_PATH_LIKE = re.compile(r"^[\w.][\w.\-/]*$")
_FILE_NAME = re.compile(r"\.(py|yml|yaml|md|j2|toml|cfg|txt)$")


def named_paths(path: Path) -> tuple[list[str], list[str]]:
    """The backticked paths of a page's prose (with a slash) and its bare file names (``loop.py``)."""
    spans = [s for line in _prose_lines(path) for s in re.findall(r"`([^`]+)`", line) if _PATH_LIKE.match(s)]
    return [s for s in spans if "/" in s], [s for s in spans if "/" not in s and _FILE_NAME.search(s)]


def test_every_path_the_first_hour_page_names_exists() -> None:
    """docs/first-hour.md walks through files by name: a path that is renamed or removed fails here. A path is
    found from the repository's root or under a folder the page names (``defaults/main.yml`` of a named role);
    a bare file name in a folder the page names (``launch.yml`` beside ``roles/finetune/tasks/main.yml``)."""
    paths, names = named_paths(REPO / "docs" / "first-hour.md")
    assert len(paths) >= 30, paths
    folders = {REPO / p.rstrip("/") if p.endswith("/") else (REPO / p).parent for p in paths}
    folders = {f for f in folders if f.is_dir()} | {REPO}
    missing = [p for p in paths if not any((f / p).exists() for f in folders)]
    missing += [n for n in names if not any((f / n).exists() for f in folders)]
    assert missing == []
