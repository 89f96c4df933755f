"""The repository's paths and its Ansible code (plugins/: filters, callbacks, modules, action plugins, module_utils),
imported the same way by every test that checks them without running Ansible."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
_ANSIBLE_CODE = ("plugins/filter", "plugins/callback", "plugins/module_utils", "plugins/modules", "plugins/action")


def ansible_code(name: str) -> ModuleType:
    """The module ``name`` (e.g. ``xeonsd_doctor``) from the plugins or the roles, loaded once a process.

    The role code is imported without Ansible itself: importing ``ansible.module_utils.basic`` patches
    ``sys.intern`` for the whole process, which breaks torch._dynamo (and so diffusers) in every later test."""
    if name in sys.modules:
        return sys.modules[name]
    paths = [p for pattern in _ANSIBLE_CODE for p in REPO.glob(f"{pattern}/{name}.py")]
    if len(paths) != 1:
        raise LookupError(f"{name}.py: expected one file under {', '.join(_ANSIBLE_CODE)}, found {paths}")
    spec = importlib.util.spec_from_file_location(name, paths[0])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def write_wrapper(etc: Path) -> Path:
    """The mpi role's wrapper (roles/mpi/templates/run.j2, /etc/xeonsd/run on the nodes) rendered into ``etc`` the
    way the role renders it: strict variables, Ansible's ``quote`` and the repository's filter plugins."""
    import shlex

    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["quote"] = shlex.quote
    for path in sorted((REPO / "plugins" / "filter").glob("*.py")):
        filters = ansible_code(path.stem).FilterModule().filters()
        env.filters.update({f"xeonsd.cluster.{name}": f for name, f in filters.items()})  # the collection's names
    template = env.from_string((REPO / "roles" / "mpi" / "templates" / "run.j2").read_text())
    run = etc / "run"
    run.write_text(template.render(ansible_managed="Ansible managed", mpi_etc_dir=str(etc)))
    run.chmod(0o755)
    return run


def local_playbook(play: Path, extra: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``ansible-playbook`` on this machine (local connection) with the repository's config, and so its collection
    xeonsd.cluster: how the tests run a role for real without the test cluster."""
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
        ANSIBLE_LOCALHOST_WARNING="false",
        ANSIBLE_INVENTORY_UNPARSED_WARNING="false",
        NO_COLOR="1",
    )
    argv = [str(VENV_BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", "-e", json.dumps(extra), str(play)]
    return subprocess.run([*argv, *args], cwd=REPO, env=env, text=True, capture_output=True, timeout=timeout)


def changed(result: subprocess.CompletedProcess) -> int:
    """The ``changed=`` count of a successful local run's recap."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (recap,) = [line for line in result.stdout.splitlines() if line.startswith("localhost ") and "changed=" in line]
    return int(recap.split("changed=")[1].split()[0])
