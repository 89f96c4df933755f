"""The generated part of every role's README: requirements, variables and an example playbook, made from the role's
own files (meta/main.yml, meta/argument_specs.yml, defaults/main.yml), the inventory's defaults and the playbook
that runs it. The prose above stays hand-written; the variables are never a third copy of the specs.

``make role-docs`` (``python tests/role_readmes.py``) rewrites the part after MARKER in each README;
tests/ansible/test_role_readmes.py fails when one is out of date."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
ROLES = REPO / "roles"
MARKER = "<!-- Generated from meta/ and defaults/ by `make role-docs`: edit those, not below. -->"
COLLECTION = "xeonsd.cluster"
LONG = 48  # a default longer than this is left to defaults/main.yml


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text()) if path.exists() else None


def inventory_defaults() -> dict[str, Any]:
    values: dict[str, Any] = {}
    for path in sorted((REPO / "inventory" / "group_vars" / "all").glob("*.yml")):
        values.update(load(path) or {})
    return values


def plays_running(role: str) -> list[tuple[str, dict]]:
    """(playbook, play) of every play under playbooks/ that lists the role."""
    found = []
    for path in sorted((REPO / "playbooks").glob("*.yml")):
        for play in load(path) or []:
            if any(r.get("role") == f"{COLLECTION}.{role}" for r in play.get("roles", [])):
                found.append((path.name, play))
    return found


def roles_used(role: str) -> list[str]:
    """The collection's roles this one imports or includes."""
    used = set()
    for path in sorted((ROLES / role / "tasks").glob("*.yml")):
        for line in path.read_text().splitlines():
            name = line.strip().removeprefix("name:").strip()
            if (
                line.strip().startswith("name:")
                and name.startswith(f"{COLLECTION}.")
                and name != f"{COLLECTION}.{role}"
            ):
                used.add(name)
    return sorted(used)


def cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def default_cell(name: str, defaults: dict, inventory: dict) -> str:
    for where, values in (("", defaults), ("inventory: ", inventory)):
        if name in values:
            value = values[name]
            if isinstance(value, str):
                shown = value.strip() if value.strip() else '""'
            else:
                shown = yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()
            return f"{where}`{cell(shown)}`" if len(shown) <= LONG else f"{where}(see the file)"
    return "—"


def wrapped(text: str, prefix: str = "") -> list[str]:
    return textwrap.wrap(text, 120, initial_indent=prefix, subsequent_indent=" " * len(prefix))


class _Indented(yaml.SafeDumper):
    """Sequences indented under their key, as the playbooks write them."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def variables(role: str, inventory: dict) -> list[str]:
    specs = load(ROLES / role / "meta" / "argument_specs.yml")["argument_specs"]
    defaults = load(ROLES / role / "defaults" / "main.yml") or {}
    lines = ["## Variables", ""]
    lines += wrapped(
        "What Ansible checks before the role runs (`meta/argument_specs.yml`), with the default from "
        "`defaults/main.yml`, or else from the sample inventory (`inventory/group_vars/all/`), where the playbooks "
        "set it for every role."
    )
    for entry, spec in specs.items():
        title = "" if entry == "main" else f" (`tasks_from: {entry}`)"
        lines += ["", f"**Entry point `{entry}`**{title}: {cell(spec.get('short_description', ''))}", ""]
        lines += ["| variable | type | required | default | what it is |", "|---|---|---|---|---|"]
        for name, option in spec.get("options", {}).items():
            kind = option.get("type", "str") + (f" of {option['elements']}" if "elements" in option else "")
            description = option.get("description", "")
            if isinstance(description, list):
                description = " ".join(description)
            required = "yes" if option.get("required") else ""
            lines.append(
                f"| `{name}` | {kind} | {required} | {default_cell(name, defaults, inventory)} | {cell(description)} |"
            )
    return lines


def requirements(role: str) -> list[str]:
    info = load(ROLES / role / "meta" / "main.yml")["galaxy_info"]
    platforms = ", ".join(f"{p['name']} {', '.join(map(str, p['versions']))}" for p in info.get("platforms", []))
    lines = ["## Requirements", ""]
    lines += wrapped(
        f"ansible-core {info['min_ansible_version']} or later, and the collection `{COLLECTION}` that this role is"
        " part of (docs/collection.md); its filters import the `xeonsd` package on the controller.",
        "- ",
    )
    lines += wrapped(f"Nodes: {platforms}.", "- ")
    if used := roles_used(role):
        lines += wrapped(f"It runs the collection's {', '.join(f'`{u}`' for u in used)} too (installed with it).", "- ")
    return lines


def example(role: str, inventory: dict) -> list[str]:
    spec = load(ROLES / role / "meta" / "argument_specs.yml")["argument_specs"]["main"]
    defaults = load(ROLES / role / "defaults" / "main.yml") or {}
    plays = plays_running(role)
    play: dict[str, Any] = {"name": f"{role} on its own", "hosts": "cluster"}
    intro = "The role alone, on the hosts of a playbook of yours"
    if plays:
        playbook, ours = plays[0]
        play.update({k: ours[k] for k in ("hosts", "become") if k in ours})
        intro = f"The role alone, as `playbooks/{playbook}` runs it"
    required = {
        name: inventory.get(name, f"<{name}>")
        for name, option in spec.get("options", {}).items()
        if option.get("required") and name not in defaults
    }
    entry: dict[str, Any] = {"role": f"{COLLECTION}.{role}"}
    if required:
        entry["vars"] = required
    play["roles"] = [entry]
    text = yaml.dump([play], Dumper=_Indented, sort_keys=False, width=110).rstrip()
    said = " (its required variables without a role default: their sample inventory's values)" if required else ""
    return ["## Example playbook", "", *wrapped(f"{intro}{said}:"), "", "```yaml", text, "```"]


def render(role: str, inventory: dict | None = None) -> str:
    inventory = inventory_defaults() if inventory is None else inventory
    parts = [MARKER, "", *requirements(role), "", *variables(role, inventory), "", *example(role, inventory)]
    return "\n".join(parts) + "\n"


def readme(role: str, inventory: dict | None = None) -> str:
    """The role's README as it should be: its hand-written part, then the generated one."""
    text = (ROLES / role / "README.md").read_text()
    prose = text.split(MARKER, 1)[0].rstrip("\n")
    return f"{prose}\n\n{render(role, inventory)}"


def all_roles() -> list[str]:
    return sorted(p.name for p in ROLES.iterdir() if (p / "meta" / "argument_specs.yml").exists())


def main() -> int:
    inventory = inventory_defaults()
    for role in all_roles():
        path = ROLES / role / "README.md"
        wanted = readme(role, inventory)
        if path.read_text() != wanted:
            path.write_text(wanted)
            print(f"rewrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
