"""The roles, playbooks and plugins are the collection xeonsd.cluster (galaxy.yml, docs/collection.md): its version
and ansible-core range agree with the pins, everything calls our code by its full name, the built archive holds
what the roles need and none of the development files, and the installed collection's entry playbooks, modules
and roles resolve from outside the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from galaxy_collection import NAME, build, install, members, user_env
from repo_code import REPO, VENV_BIN

ENTRY_PLAYBOOKS = ("provision", "preflight", "doctor", "finetune", "train", "export", "serve")


def test_the_version_is_the_trainers_and_the_ansible_range_holds_the_pin() -> None:
    galaxy = yaml.safe_load((REPO / "galaxy.yml").read_text())
    (version,) = re.findall(r'^version = "([^"]+)"$', (REPO / "train" / "pyproject.toml").read_text(), re.M)
    assert f"{galaxy['namespace']}.{galaxy['name']}" == NAME and galaxy["version"] == version
    requires = yaml.safe_load((REPO / "meta" / "runtime.yml").read_text())["requires_ansible"]
    floor, ceiling = re.fullmatch(r">=(\d+\.\d+)\.0,<(\d+\.\d+)\.0", requires).groups()
    (pin,) = re.findall(r"^ansible-core==(\d+\.\d+)\.\d+$", (REPO / "requirements-dev.txt").read_text(), re.M)
    as_tuple = lambda v: tuple(map(int, v.split(".")))  # noqa: E731
    assert as_tuple(floor) <= as_tuple(pin) < as_tuple(ceiling), (requires, pin)
    for meta in sorted(REPO.glob("roles/*/meta/main.yml")):
        assert yaml.safe_load(meta.read_text())["galaxy_info"]["min_ansible_version"] == floor, meta


def test_the_plays_call_our_code_by_its_full_name() -> None:
    """No role, module or filter of ours by its short name in a play, a role, a template or the inventory (the
    checkout no longer sets roles_path, library or filter_plugins: a short name would fail when its task runs)."""
    modules = "|".join(p.stem for p in (REPO / "plugins" / "modules").glob("*.py"))
    roles = "|".join(p.name for p in (REPO / "roles").iterdir() if p.is_dir())
    short = re.compile(
        rf"(\|\s*xeonsd_\w+|map\(\s*['\"]xeonsd_\w+|^\s*-?\s*(role|name):\s*({roles})\s*$|^\s*-?\s*({modules}):)", re.M
    )
    files = [
        p
        for top in ("roles", "playbooks", "inventory")
        for p in (REPO / top).rglob("*")
        if p.suffix in (".yml", ".j2") and "argument_specs" not in p.name
    ]
    found = [f"{p.relative_to(REPO)}: {m[0].strip()}" for p in files for m in short.finditer(p.read_text())]
    assert found == []
    assert (REPO / "collections" / "ansible_collections" / "xeonsd" / "cluster").resolve() == REPO


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("build"))


def test_the_archive_holds_what_the_roles_need_and_no_development_files(archive: Path) -> None:
    names = set(members(archive))
    roles = sorted(p.name for p in (REPO / "roles").iterdir() if p.is_dir())
    needed = {
        "MANIFEST.json",
        "meta/runtime.yml",
        "docs/collection.md",
        "train/pyproject.toml",
        "train/src/xeonsd/cli.py",
        "requirements.txt",
        "requirements-nodeps.txt",
        "inventory/group_vars/all/versions.yml",
        *(f"roles/{r}/tasks/main.yml" for r in roles),
        *(f"roles/{r}/meta/argument_specs.yml" for r in roles),
        *(f"playbooks/{p}.yml" for p in ENTRY_PLAYBOOKS),
        *(str(p.relative_to(REPO)) for p in (REPO / "plugins").rglob("*.py")),
    }
    assert needed - names == set()
    tops = {n.split("/")[0] for n in names}
    assert not tops & {"tests", "collections", ".git", ".venv", ".cache", ".cluster", "ansible.cfg", "Makefile"}
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


def test_the_installed_collection_runs_its_playbooks_modules_and_roles_by_their_full_names(
    archive: Path, tmp_path: Path
) -> None:
    """From a directory outside the repository, Ansible with only the installed collection: every entry playbook
    passes --syntax-check (its roles, tasks and modules resolve), a module's and a role's docs are there."""
    installed = install(archive, tmp_path / "collections")
    assert (installed / "roles" / "finetune" / "tasks" / "main.yml").is_file()
    user = tmp_path / "user"
    user.mkdir()
    env = user_env(tmp_path / "collections")

    def ansible(tool: str, *argv: str) -> str:
        done = subprocess.run(
            [str(VENV_BIN / tool), *argv], cwd=user, env=env, text=True, capture_output=True, timeout=300
        )
        assert done.returncode == 0, (argv, done.stdout[-3000:], done.stderr[-3000:])
        return done.stdout

    inventory = str(installed / "inventory" / "hosts.yml")
    checked = ansible("ansible-playbook", "-i", inventory, "--syntax-check", *(f"{NAME}.{p}" for p in ENTRY_PLAYBOOKS))
    assert checked.count("playbook: ") == len(ENTRY_PLAYBOOKS), checked
    module = ansible("ansible-doc", "-t", "module", f"{NAME}.xeonsd_sha256")
    assert module.startswith(f"> MODULE {NAME}.xeonsd_sha256 ({installed}") and "sha256" in module, module[:300]
    role = ansible("ansible-doc", "-t", "role", f"{NAME}.dataset")
    assert "dataset_expected_count" in role and str(installed) in role
