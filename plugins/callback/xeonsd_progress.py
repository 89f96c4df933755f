"""Job progress: while finetune.yml waits for the training job, one line per poll with its step, loss and s/step.

Ansible prints only "FAILED - RETRYING" while a task repeats with `until`; this callback prints the message of
each poll of the finetune role's xeonsd_job module instead (step/total, loss, s/step, time left, CPU use), and one
warning for each node the trainer flagged as a straggler.
"""

from __future__ import annotations

from ansible import constants as C
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

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self._warned: set[tuple[str, str]] = set()

    def _warn_stragglers(self, result) -> None:  # noqa: ANN001
        for node, text in (result._result.get("straggler_warnings") or {}).items():
            key = (result._host.get_name(), node)
            if key not in self._warned:  # one warning per straggler node, not one per poll
                self._warned.add(key)
                # One unwrapped line (Display.warning wraps at the terminal's width), so that it can be grepped.
                self._display.display(f"[WARNING]: Straggler: {text}", color=C.COLOR_WARN, stderr=True)

    def v2_runner_retry(self, result):  # noqa: ANN001
        if result._task.action.split(".")[-1] != "xeonsd_job":
            return
        msg = result._result.get("msg")
        if msg:
            self._display.display(f"  {result._host.get_name()}: {msg}")
        self._warn_stragglers(result)

    def v2_runner_on_ok(self, result):  # noqa: ANN001
        if result._task.action.split(".")[-1] == "xeonsd_job":
            self._warn_stragglers(result)
