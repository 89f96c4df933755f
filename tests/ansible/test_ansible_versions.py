"""Every pin in one place: what versions.yml says must agree with requirements.txt, and the roles restate no
Python pin of the stock stack."""

from __future__ import annotations

import re

import yaml
from repo_code import REPO


def requirement_pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)==([^\s;#]+)", line)
        if m:
            pins[m[1].lower()] = m[2]
    return pins


def versions() -> dict:
    return yaml.safe_load((REPO / "inventory/group_vars/all/versions.yml").read_text())


def test_diffusers_git_ref_matches_the_requirements_pin() -> None:
    assert versions()["diffusers_git_ref"] == "v" + requirement_pins()["diffusers"]


def test_seed_stack_replaces_only_packages_of_requirements() -> None:
    pins = requirement_pins()
    for name in versions()["seed_excluded_requirements"]:
        assert name.lower() in pins, f"{name} is not in requirements.txt"


def test_miniforge_is_pinned_with_a_sha256() -> None:
    v = versions()
    assert re.fullmatch(r"\d+\.\d+\.\d+-\d+", v["miniforge_version"])
    assert re.fullmatch(r"[0-9a-f]{64}", v["miniforge_sha256"])


def test_roles_restate_no_stock_pin() -> None:
    pinned = requirement_pins()
    for path in [*(REPO / "roles").rglob("*.yml"), *(REPO / "inventory").rglob("*.yml")]:
        text = path.read_text().lower()
        for name, version in pinned.items():
            assert f"{name}=={version}" not in text, f"{path} restates the pin {name}=={version}"
