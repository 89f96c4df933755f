#!/usr/bin/python
"""Ansible module: several small text files written in one task (one module run on the node instead of a stat
and a copy per ``template`` task): each file that differs in content, mode or owner is written to a temporary
name beside it and renamed into place, the others are left alone. The mpi role writes the nodefile, env.sh, the
run wrapper and known_hosts with it.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.xeonsd.cluster.plugins.module_utils.xeonsd_atomic import write_atomic

DOCUMENTATION = r"""
module: xeonsd_files
short_description: Write several small text files in one task, each only where it differs
description:
  - For each of C(files), compares the node's file with C(content), C(mode) and C(owner)/C(group); a file that
    differs (or is missing) is written to a temporary name in its directory and renamed into place, so a crash
    never leaves half a file. Reports changed when any file was written, and which (C(written)). Check mode says
    what would be written and writes nothing; diff mode shows the content changes.
options:
  files:
    description:
      - Each C({path, content, mode}) (mode as an octal string, e.g. C("0644")), optionally C(owner) and C(group)
        (names); without them a new file belongs to the task's user and an existing one keeps its owner.
      - The parent directory must exist.
    type: list
    elements: dict
    required: true
"""


def _ids(module: AnsibleModule, item: dict) -> tuple[int, int]:
    """(uid, gid) the file must have; -1 where the item leaves it alone."""
    try:
        uid = pwd.getpwnam(item["owner"]).pw_uid if item.get("owner") else -1
        gid = grp.getgrnam(item["group"]).gr_gid if item.get("group") else -1
    except KeyError as e:
        module.fail_json(msg=f"{item['path']}: no such user or group on this node: {e}")
    return uid, gid


def _current(path: str) -> tuple[bytes | None, os.stat_result | None]:
    try:
        with open(path, "rb") as f:
            return f.read(), os.fstat(f.fileno())
    except FileNotFoundError:
        return None, None


def main() -> None:
    module = AnsibleModule(
        argument_spec={"files": {"type": "list", "elements": "dict", "required": True}},
        supports_check_mode=True,
    )
    written, diffs = [], []
    for item in module.params["files"]:
        missing = [k for k in ("path", "content", "mode") if k not in item]
        if missing:
            module.fail_json(msg=f"xeonsd_files: every file needs path, content and mode; {item} has no {missing}")
        path, data = str(item["path"]), str(item["content"]).encode()
        try:
            mode = int(str(item["mode"]), 8)
        except ValueError:
            module.fail_json(msg=f"{path}: mode {item['mode']!r} is not an octal mode such as '0644'")
        uid, gid = _ids(module, item)
        old, st = _current(path)
        same = (
            st is not None
            and old == data
            and stat.S_IMODE(st.st_mode) == mode
            and uid in (-1, st.st_uid)
            and gid in (-1, st.st_gid)
        )
        if same:
            continue
        written.append(path)
        if module._diff:
            diffs.append(
                {
                    "before_header": path,
                    "after_header": path,
                    "before": (old or b"").decode(errors="replace"),
                    "after": data.decode(),
                }
            )
        if not module.check_mode:
            try:
                # An existing file keeps the owner the item does not name.
                keep = (st.st_uid, st.st_gid) if st is not None else (-1, -1)
                write_atomic(path, data, mode, (uid if uid != -1 else keep[0], gid if gid != -1 else keep[1]))
            except OSError as e:
                module.fail_json(msg=f"{path}: cannot write it: {e}", written=written[:-1])
    module.exit_json(changed=bool(written), written=written, diff=diffs)


if __name__ == "__main__":
    main()
