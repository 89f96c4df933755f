"""How the finetune role's modules ask the node's ``xeonsd`` about a job: the command lines and their JSON answer.

The reading itself (progress, the ranks' status files, who ended a failed job) and the files' schema live in the
xeonsd package (``xeonsd.jobs.watch`` and ``xeonsd.contracts.job_status``), installed in the diffuser env on every
node; the modules run ``xeonsd jobstatus poll`` / ``ranks`` there through the mpi role's wrapper (``env_wrapper``,
which sources env.sh) and return what it prints. Nothing here knows a field of those files. Nothing here imports
Ansible either, so the tests run these functions directly; the modules are only the Ansible wrappers.
"""

from __future__ import annotations

import json


def jobstatus_argv(env_wrapper: str, action: str, run_dir: str) -> list[str]:
    """``xeonsd jobstatus ACTION RUN_DIR``: ``stop`` (SIGTERM to the job's run.sh, which stops the job cleanly:
    xeonsd_job ``stop``), ``ranks`` (this node's rank status files) or ``poll`` (with its flags: :func:`poll_argv`)."""
    return [env_wrapper, "xeonsd", "jobstatus", action, run_dir]


def poll_argv(params: dict) -> list[str]:
    """``xeonsd jobstatus poll`` for xeonsd_job's parameters (the gathered rank statuses go on stdin)."""
    argv = jobstatus_argv(params["env_wrapper"], "poll", params["run_dir"])
    # a table: one flag and its value a line (ruff would put one item per line)
    argv += [
        "--results-file", params["results_file"],
        "--total-steps", str(params["total_steps"]),
        "--ranks-per-node", str(params["ranks_per_node"]),
        "--excerpt-lines", str(params["excerpt_lines"]),
        "--wait-s", str(params.get("wait_s") or 0),
    ]  # fmt: skip
    for i, name in enumerate(params["node_names"]):  # the module checked that the two lists match
        argv += ["--node", f"{name}={params['node_addresses'][i]}"]
    if params.get("rank_status") is not None:
        argv += ["--rank-status", "-"]
    return argv


def poll_stdin(params: dict) -> str | None:
    return None if params.get("rank_status") is None else json.dumps(params["rank_status"])


def answer(argv: list[str], rc: int, stdout: str, stderr: str) -> dict:
    """What the command printed, or ValueError saying why there is no answer."""
    if rc != 0:
        raise ValueError(f"{' '.join(argv[1:4])} failed (rc {rc}): {stderr.strip() or stdout.strip()}")
    try:
        data = json.loads(stdout)
    except ValueError as exc:
        raise ValueError(f"{' '.join(argv[1:4])} printed no JSON ({exc}): {stdout[:300]!r}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{' '.join(argv[1:4])} printed {type(data).__name__}, not a JSON object")
    return data
