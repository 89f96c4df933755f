"""Job progress: while finetune.yml waits for the training job, one line per poll with its step, loss and s/step.

Ansible prints only "FAILED - RETRYING" while a task repeats with `until`; this callback prints the message of
each poll of the finetune role's xeonsd_job module instead (step/total, loss, s/step, time left).
"""

from __future__ import annotations

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
    name: xeonsd_progress
    type: notification
    short_description: print the training job's progress on every poll
    description:
      - On every retry of the xeonsd_job module (the finetune role's poll), prints the job's progress line.
    requirements:
      - enable in ansible.cfg (callbacks_enabled = xeonsd_progress)
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "notification"
    CALLBACK_NAME = "xeonsd_progress"
    CALLBACK_NEEDS_ENABLED = True

    def v2_runner_retry(self, result):  # noqa: ANN001
        if result._task.action.split(".")[-1] != "xeonsd_job":
            return
        msg = result._result.get("msg")
        if msg:
            self._display.display(f"  {result._host.get_name()}: {msg}")
