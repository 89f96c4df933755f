#!/usr/bin/python
"""Ansible module: this node's rank status files of a finetune run (``<run_dir>/status/rank-<r>.json``).

Each rank writes its own on its own node (xeonsd.contracts.job_status); the finetune role runs this on every node after a
failed job and hands what it found to xeonsd_job on the primary, which decides who ended the job. The reading is the
node's ``xeonsd jobstatus ranks``, run in the diffuser env through the mpi role's wrapper.
"""

from __future__ import annotations

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.xeonsd.cluster.plugins.module_utils.xeonsd_joblog import answer, jobstatus_argv

DOCUMENTATION = r"""
module: xeonsd_rank_status
short_description: Read the rank status files an xeonsd training job left on this node
description:
  - Returns the parsed C(status/rank-*.json) files of a run directory on this node. A file that is not JSON comes
    back as C({file, problem}); xeonsd_job checks the schema when it diagnoses. No run or status directory on this
    node (no rank started here) gives an empty list.
options:
  env_wrapper:
    description: The mpi role's wrapper that runs a command in the diffuser env (C(xeonsd jobstatus ranks)).
    type: path
    required: true
  run_dir:
    description: The run directory (the same path on every node).
    type: path
    required: true
"""


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "env_wrapper": {"type": "path", "required": True},
            "run_dir": {"type": "path", "required": True},
        },
        supports_check_mode=True,
    )
    argv = jobstatus_argv(module.params["env_wrapper"], "ranks", module.params["run_dir"])
    rc, out, err = module.run_command(argv)
    try:
        found = answer(argv, rc, out, err)
    except ValueError as exc:
        module.fail_json(msg=f"cannot read this node's rank status files: {exc}")
    module.exit_json(changed=False, **found)


if __name__ == "__main__":
    main()
