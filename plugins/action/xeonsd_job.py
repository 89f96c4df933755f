"""Action plugin of xeonsd_job: runs the module on the primary, and asks it to stop the job once the play was
interrupted (Ctrl-C on the controller).

The xeonsd_progress callback (plugins/callback) catches the first Ctrl-C while the finetune role waits for the job,
and creates the file named by the environment variable below (the callback sets it when it loads, before any
worker forks). Every poll of the wait is a run of this plugin in the task's worker: the first one that finds the
file passes ``stop: true`` to the module (SIGTERM to the job's run.sh: every rank stops after its current step,
rank 0 writes a checkpoint) and removes the file; the polls that follow see the job end and the role reports the
stop as for any SIGTERM.
"""

from __future__ import annotations

import contextlib
import os

from ansible.plugins.action import ActionBase

# The name is the callback's (xeonsd_progress.INTERRUPT_FILE_ENV); tests/ansible/test_run_sh.py's Ctrl-C play fails
# when the two differ (the stop is then never asked for).
INTERRUPT_FILE_ENV = "XEONSD_INTERRUPT_FILE"


class ActionModule(ActionBase):
    _supports_check_mode = True

    def run(self, tmp=None, task_vars=None):  # noqa: ANN001, ANN201
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        flag = os.environ.get(INTERRUPT_FILE_ENV)
        interrupted = bool(flag) and os.path.exists(flag)
        if interrupted:
            args["stop"] = True
        result.update(
            self._execute_module(module_name="xeonsd.cluster.xeonsd_job", module_args=args, task_vars=task_vars)
        )
        if interrupted and not result.get("failed"):
            with contextlib.suppress(FileNotFoundError):  # the stop was asked for once: later polls only read
                os.remove(flag)
        return result
