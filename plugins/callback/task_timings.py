"""Task timings: how long each task took, summed over hosts, and the slowest tasks at the end of the run.

ansible-core ships no timing callback (profile_tasks lives in the ansible.posix collection, which is not
installable without Galaxy), so this small aggregate callback does the same job.
"""

from __future__ import annotations

import os
import time

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
    name: task_timings
    type: aggregate
    short_description: print task wall times and the slowest tasks of the run
    description:
      - After the run, prints the total wall time and the slowest tasks (TASK_TIMINGS_TOP, default 12).
    requirements:
      - enable in ansible.cfg (callbacks_enabled = task_timings)
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "task_timings"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self) -> None:
        super().__init__()
        self._start = time.monotonic()
        self._current: tuple[str, float] | None = None
        self._timings: list[tuple[str, float]] = []

    def _begin(self, name: str | None) -> None:
        """Close the running task's timing, and start ``name``'s (None: the run is over)."""
        if self._current is not None:
            began_name, began = self._current
            self._timings.append((began_name, time.monotonic() - began))
        self._current = None if name is None else (name, time.monotonic())

    def v2_playbook_on_task_start(self, task, is_conditional):  # noqa: ANN001
        self._begin(task.get_name())

    def v2_playbook_on_handler_task_start(self, task):  # noqa: ANN001
        self._begin(f"handler: {task.get_name()}")

    def v2_playbook_on_stats(self, stats):  # noqa: ANN001
        self._begin(None)
        top = int(os.environ.get("TASK_TIMINGS_TOP", "12"))
        total = time.monotonic() - self._start
        self._display.display(f"TASK TIMINGS (slowest {top}; run wall time {total:.1f} s)")
        for name, seconds in sorted(self._timings, key=lambda t: t[1], reverse=True)[:top]:
            self._display.display(f"  {seconds:8.1f} s  {name}")
