"""The repository's paths and its Ansible code (filter and callback plugins, role modules and module_utils),
imported the same way by every test that checks them without running Ansible."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
_ANSIBLE_CODE = ("plugins/filter", "plugins/callback", "roles/*/module_utils", "roles/*/library")


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
