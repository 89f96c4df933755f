#!/usr/bin/python
"""Ansible module: this node's rank status files of a finetune run (``<run_dir>/status/rank-<r>.json``).

Each rank writes its own on its own node (xeonsd.cluster.job_status); the finetune role runs this on every node after a
failed job and hands what it found to xeonsd_job on the primary, which decides who ended the job.
"""

from __future__ import annotations

import os

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.xeonsd_joblog import STATUS_DIR, read_status_dir

DOCUMENTATION = r"""
module: xeonsd_rank_status
short_description: Read the rank status files an xeonsd training job left on this node
description:
  - Returns the parsed C(status/rank-*.json) files of a run directory on this node. A file that is not JSON comes
    back as C({file, problem}); xeonsd_job checks the schema when it diagnoses. No run or status directory on this
    node (no rank started here) gives an empty list.
options:
  run_dir:
    description: The run directory (the same path on every node).
    type: path
    required: true
"""


def main() -> None:
    module = AnsibleModule(argument_spec={"run_dir": {"type": "path", "required": True}}, supports_check_mode=True)
    status_dir = os.path.join(module.params["run_dir"], STATUS_DIR)
    module.exit_json(changed=False, status_dir=status_dir, statuses=read_status_dir(status_dir))


if __name__ == "__main__":
    main()
