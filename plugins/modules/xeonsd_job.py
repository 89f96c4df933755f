#!/usr/bin/python
"""Ansible module: the state of a finetune job on the primary (progress while it runs, diagnosis when it failed).

The reading and the diagnosis are the node's ``xeonsd jobstatus poll`` (xeonsd.jobs.watch, in the diffuser
env, run through the mpi role's wrapper); this is the Ansible wrapper, and plugins/module_utils/xeonsd_joblog.py builds its
command line. The diagnosis reads the ranks' status files (``status/rank-<r>.json``, xeonsd.contracts.job_status):
those gathered from every node by xeonsd_rank_status when ``rank_status`` is given, else this node's own.
"""

from __future__ import annotations

import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.xeonsd.cluster.plugins.module_utils.xeonsd_joblog import (
    answer,
    jobstatus_argv,
    poll_argv,
    poll_stdin,
)

DOCUMENTATION = r"""
module: xeonsd_job
short_description: Progress and failure diagnosis of an xeonsd finetune job
description:
  - Reports whether the job launched by the finetune role has finished, its progress (step, loss, s/step,
    time left) and, for a failed job, which node and ranks caused it with the first lines of their log.
options:
  env_wrapper:
    description: The mpi role's wrapper that runs a command in the diffuser env (C(xeonsd jobstatus poll)).
    type: path
    required: true
  run_dir:
    description: The job's run directory on the primary.
    type: path
    required: true
  results_file:
    description: Ansible's async results file of the launch task.
    type: path
    required: true
  node_names:
    description: The cluster's inventory names in nodefile order (primary first).
    type: list
    elements: str
    default: []
  node_addresses:
    description: Their MPI addresses, in the same order.
    type: list
    elements: str
    default: []
  ranks_per_node:
    description: mpirun -ppn, to place ranks that never logged their node.
    type: int
    default: 1
  total_steps:
    description: max_train_steps of the job.
    type: int
    required: true
  excerpt_lines:
    description: How many log lines of the failing ranks to return.
    type: int
    default: 12
  rank_status:
    description:
      - The rank status files of the job, gathered from every node (the C(statuses) of xeonsd_rank_status).
      - Omitted, a failed job is diagnosed from this node's own status directory only.
    type: list
    elements: dict
  wait_s:
    description:
      - A long poll. The module answers as soon as the job ends, or after this many seconds with its progress. So
        the role polls every C(finetune_poll_s) and still sees the end at once.
    type: float
    default: 0
  stop:
    description:
      - Stop the job cleanly before reading its state (SIGTERM to its run.sh, C(xeonsd jobstatus stop)); the result
        then has C(stop) (C(signalled), C(pid), C(message)). The job's end comes in a later poll.
      - The role's action plugin sets it when the play was interrupted (Ctrl-C: the xeonsd_progress callback).
    type: bool
    default: false
"""


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "env_wrapper": {"type": "path", "required": True},
            "run_dir": {"type": "path", "required": True},
            "results_file": {"type": "path", "required": True},
            "node_names": {"type": "list", "elements": "str", "default": []},
            "node_addresses": {"type": "list", "elements": "str", "default": []},
            "ranks_per_node": {"type": "int", "default": 1},
            "total_steps": {"type": "int", "required": True},
            "excerpt_lines": {"type": "int", "default": 12},
            "rank_status": {"type": "list", "elements": "dict"},
            "stop": {"type": "bool", "default": False},
            "wait_s": {"type": "float", "default": 0.0},
        },
        supports_check_mode=True,
    )
    params = dict(module.params)
    if len(params["node_names"]) != len(params["node_addresses"]):
        module.fail_json(msg="node_names and node_addresses must have the same length")
    if not os.path.isdir(params["run_dir"]):
        module.fail_json(msg=f"run directory {params['run_dir']} does not exist on this node")
    stopped = None
    if params["stop"] and not module.check_mode:
        argv = jobstatus_argv(params["env_wrapper"], "stop", params["run_dir"])
        rc, out, err = module.run_command(argv)
        try:
            stopped = answer(argv, rc, out, err)
        except ValueError as exc:
            module.fail_json(msg=f"cannot stop the job: {exc}")
    argv = poll_argv(params)
    rc, out, err = module.run_command(argv, data=poll_stdin(params))
    try:
        state = answer(argv, rc, out, err)
    except ValueError as exc:  # an exit.json of another schema, or no xeonsd in the env
        module.fail_json(msg=f"cannot read the job's state: {exc}")
    if stopped is not None:
        state["stop"] = stopped
    module.exit_json(**state)


if __name__ == "__main__":
    main()
