#!/usr/bin/python
"""Ansible module: files checked against the sha256 they must have, where they lie (a node, or the controller with
``delegate_to: localhost``): staged installers and archives, the dataset's images. One task per check; a file that
is missing or differs fails it with a message that names the file, both checksums and the fix.
"""

from __future__ import annotations

import hashlib
import os

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: xeonsd_sha256
short_description: Check files against the sha256 they must have
description:
  - Hashes every file of C(files) where the task runs and fails, naming each file that is missing, not a regular
    file or has another sha256, with what to do. Changes nothing (check mode runs it too).
options:
  files:
    description:
      - The files, each C({path, sha256}); each may set its own C(what), C(says) and C(fix) for its message.
      - An empty C(sha256) means none is known for the file (it fails).
    type: list
    elements: dict
    required: true
  what:
    description: What the files are (the message's words), unless a file says.
    type: str
    default: file
  where:
    description: Where they lie (a node's name, the controller), for the message.
    type: str
    required: true
  says:
    description: The variable that holds the expected sha256, for the message, unless a file says.
    type: str
    default: the expected sha256
  fix:
    description: What to do when a file does not match, unless a file says.
    type: str
    default: stage the right file there
"""

CHUNK = 1 << 20


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def problem(item: dict, found: str | None, where: str, defaults: dict) -> str:
    """The message for one file whose sha256 (``found``; None: it does not exist, "": not a regular file) is not
    ``item["sha256"]``."""
    what, says, fix = (item.get(k) or defaults[k] for k in ("what", "says", "fix"))
    expected = item.get("sha256") or "nothing for this file"
    if found is None:
        state = f"does not exist on {where}"
    else:
        state = f"on {where} has sha256 {found or 'none (not a regular file)'}"
    return f"{item['path']} ({what}) {state}; {says} says {expected}. Fix: {fix}."


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "files": {"type": "list", "elements": "dict", "required": True},
            "what": {"type": "str", "default": "file"},
            "where": {"type": "str", "required": True},
            "says": {"type": "str", "default": "the expected sha256"},
            "fix": {"type": "str", "default": "stage the right file there"},
        },
        supports_check_mode=True,
    )
    p = module.params
    defaults = {k: p[k] for k in ("what", "says", "fix")}
    checked, problems = [], []
    for item in p["files"]:
        if "path" not in item:
            module.fail_json(msg=f"xeonsd_sha256: every file needs a path, got {item}")
        path = str(item["path"])
        if not os.path.lexists(path):
            found = None
        elif not os.path.isfile(path):
            found = ""
        else:
            try:
                found = sha256_of(path)
            except OSError as e:
                module.fail_json(msg=f"{path}: cannot read it on {p['where']}: {e}")
        checked.append({"path": path, "sha256": found})
        if not found or found != str(item.get("sha256") or ""):
            problems.append(problem(item, found, p["where"], defaults))
    if problems:
        module.fail_json(msg=" ".join(problems), files=checked)
    module.exit_json(changed=False, files=checked)


if __name__ == "__main__":
    main()
