"""Every role's README ends with its requirements, variables and an example playbook, generated from the role's
own files (tests/role_readmes.py, ``make role-docs``): the variables are the argument specs', never a third copy."""

from __future__ import annotations

import pytest
import yaml
from role_readmes import MARKER, ROLES, all_roles, inventory_defaults, readme


@pytest.mark.parametrize("role", all_roles())
def test_the_readme_is_generated_from_the_roles_files(role: str) -> None:
    text = (ROLES / role / "README.md").read_text()
    assert MARKER in text, f"roles/{role}/README.md has no generated part: run make role-docs"
    assert text == readme(role, inventory_defaults()), f"roles/{role}/README.md is out of date: run make role-docs"


def test_the_specs_name_every_default_a_user_may_set() -> None:
    """A variable with a role default is in the role's argument specs (so in its README), but the ones the
    defaults file itself marks as derived (not meant to be set)."""
    missing = []
    for role in all_roles():
        text = (ROLES / role / "defaults" / "main.yml").read_text()
        defaults = yaml.safe_load(text) or {}
        specs = yaml.safe_load((ROLES / role / "meta" / "argument_specs.yml").read_text())["argument_specs"]
        named = {name for spec in specs.values() for name in spec.get("options", {})}
        lines = text.splitlines()
        for name in defaults:
            at = next(i for i, line in enumerate(lines) if line.startswith(f"{name}:"))
            derived = at > 0 and lines[at - 1].endswith("(derived; not meant to be set).")
            if name not in named and not derived:
                missing.append(f"{role}: {name}")
    assert missing == []
