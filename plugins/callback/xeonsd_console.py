"""Ansible's default screen output, except that a task repeated by ``until`` while it waits does not print FAILED.

The default callback prints ``FAILED - RETRYING: [host]: task (N retries left).`` for every repeat of an ``until``
task, whether the attempt failed or only has not reached its condition yet. The finetune role's wait for the
training job (xeonsd_job, every ``finetune_poll_s``) repeats thousands of times in a long run, and every repeat is a
wait that works: xeonsd_progress (plugins/callback) prints its progress line instead, and this prints nothing. An
other task's wait (the ml_stack install, the Slurm daemons) prints ``WAITING: [host]: task (N retries left).``. An
attempt that did fail (the module failed, the host could not be reached) still prints the default line, with the
module's message, at every verbosity.
"""

from __future__ import annotations

from ansible import constants as C
from ansible.plugins.callback.default import CallbackModule as DefaultCallback

DOCUMENTATION = """
    name: xeonsd_console
    type: stdout
    short_description: default Ansible screen output without FAILED lines for a wait that works
    description:
      - Ansible's default stdout callback, except for the repeats of a task with C(until).
      - A repeat whose attempt did not fail is a wait. The training job's poll (xeonsd_job) prints nothing, since
        the xeonsd_progress callback prints its progress line. Any other task prints a WAITING line.
      - A repeat whose attempt failed prints the default FAILED - RETRYING line with the module's message.
    extends_documentation_fragment:
      - default_callback
      - result_format_callback
    requirements:
      - set as stdout in configuration (stdout_callback = xeonsd_console)
"""

# The modules whose every poll xeonsd_progress prints a line for (its own test: the task's action's last part).
PROGRESS_MODULES = frozenset({"xeonsd_job"})


def failed_attempt(result: dict) -> bool:
    """Whether the attempt behind a retry failed (not merely short of the task's ``until``). Ansible 2.19 hands
    callbacks a retry's result without its ``failed`` key; a module's fail_json and an action's error leave an
    ``exception`` (since 2.19 always), a module that crashed its ``module_stderr``."""
    keys = ("failed", "unreachable", "exception", "module_stderr", "failed_when_result")
    return any(result.get(k) for k in keys)


class CallbackModule(DefaultCallback):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "stdout"
    CALLBACK_NAME = "xeonsd_console"

    def v2_runner_retry(self, result) -> None:  # noqa: ANN001
        attempt = result._result
        failed = failed_attempt(attempt)
        if not failed and result._task.action.split(".")[-1] in PROGRESS_MODULES:
            return  # xeonsd_progress prints the poll's progress line
        left = attempt["retries"] - attempt["attempts"]
        head = "FAILED - RETRYING" if failed else "WAITING"
        msg = f"{head}: [{self.host_label(result)}]: {result.task_name or result.task} ({left} retries left)."
        if failed and attempt.get("msg"):
            msg += f" {attempt['msg']}"
        if self._run_is_verbose(result, verbosity=2):
            msg += f" Result was: {self._dump_results(attempt)}"
        self._display.display(msg, color=C.COLOR_ERROR if failed else C.COLOR_DEBUG)
