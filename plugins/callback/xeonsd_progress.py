"""Job progress: while finetune.yml waits for the training job, one line per poll with its step, loss and s/step.

Ansible's default output prints only "FAILED - RETRYING" while a task repeats with `until`; the repository's
stdout callback (xeonsd_console) prints nothing for a poll that only waits, and this callback prints the message of
each such poll of the finetune role's xeonsd_job module (step/total, loss, s/step, time left, CPU use), one
warning for each node the trainer flagged as a straggler, and one when every node is low on CPU (the layout or the
shared load: the trainer's layout verdict).

It also makes Ctrl-C stop the job, not just the play. While the wait runs, the first Ctrl-C (SIGINT to
ansible-playbook) creates the file named by INTERRUPT_FILE_ENV, and the play goes on. The next poll (the role's
xeonsd_job action plugin) then stops the job cleanly: SIGTERM to its run.sh, every rank stops after its current
step, and rank 0 writes a checkpoint. Under Slurm, run.sh passes it on with scancel. The play then reports the
stop and fetches the report, as for any SIGTERM. A second Ctrl-C is Ansible's own: the play ends at once.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import tempfile

from ansible import constants as C
from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
    name: xeonsd_progress
    type: notification
    short_description: print the training job's progress on every poll
    description:
      - On every retry of the xeonsd_job module (the finetune role's poll), prints the job's progress line.
      - While that poll runs, the first Ctrl-C stops the job cleanly (checkpoint at the step the ranks agree on).
        The play goes on and reports the stop. A second Ctrl-C ends the play at once.
    requirements:
      - enable in ansible.cfg (callbacks_enabled = xeonsd_progress)
"""


# The file that tells the finetune role's xeonsd_job action plugin to stop the job (its INTERRUPT_FILE_ENV).
INTERRUPT_FILE_ENV = "XEONSD_INTERRUPT_FILE"
STOPPING = (
    "\n[xeonsd] Ctrl-C: stopping the training job cleanly. At the next poll its run.sh gets SIGTERM: every rank stops"
    " after its current step, rank 0 writes a checkpoint there, and the play reports it (resume with -e"
    " resume=latest). Ctrl-C again to leave the play now: a job already told to stop still stops, else it runs on.\n"
)


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "notification"
    CALLBACK_NAME = "xeonsd_progress"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self._warned: set[tuple[str, str]] = set()
        # Set before any worker forks, so that each one's xeonsd_job action plugin finds it.
        self._interrupt_file = os.path.join(tempfile.gettempdir(), f"xeonsd-interrupt-{os.getpid()}")
        os.environ[INTERRUPT_FILE_ENV] = self._interrupt_file
        atexit.register(self._forget_interrupt)
        self._ansible_sigint = None  # Ansible's SIGINT handler, while ours stands in for it
        self._stop_asked = False

    def _forget_interrupt(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._interrupt_file)

    def _on_sigint(self, signum, frame) -> None:  # noqa: ANN001
        """The first Ctrl-C while the job runs: ask the next poll to stop it; the second: Ansible's own."""
        if self._stop_asked:
            ansible_handler = self._ansible_sigint
            self._restore_sigint()
            if callable(ansible_handler):
                ansible_handler(signum, frame)
            raise KeyboardInterrupt
        self._stop_asked = True
        with contextlib.suppress(FileExistsError):
            os.close(os.open(self._interrupt_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        # os.write, not Display: a signal handler must not wait for the lock that the interrupted code may hold.
        os.write(2, STOPPING.encode())

    def _restore_sigint(self) -> None:
        if self._ansible_sigint is not None:
            signal.signal(signal.SIGINT, self._ansible_sigint)
            self._ansible_sigint = None

    def v2_playbook_on_task_start(self, task, is_conditional):  # noqa: ANN001
        if task.action.split(".")[-1] == "xeonsd_job":
            if self._ansible_sigint is None:
                self._ansible_sigint = signal.getsignal(signal.SIGINT)
                signal.signal(signal.SIGINT, self._on_sigint)
        else:
            self._restore_sigint()

    def v2_playbook_on_stats(self, stats):  # noqa: ANN001
        self._restore_sigint()

    def _warn_stragglers(self, result) -> None:  # noqa: ANN001
        layout = result._result.get("layout_warning")
        key = (result._host.get_name(), "")
        if layout and key not in self._warned:  # every node low on CPU: said once, not per node nor per poll
            self._warned.add(key)
            self._display.display(f"[WARNING]: Low CPU on every node: {layout}", color=C.COLOR_WARN, stderr=True)
        for node, text in (result._result.get("straggler_warnings") or {}).items():
            key = (result._host.get_name(), node)
            if key not in self._warned:  # one warning per straggler node, not one per poll
                self._warned.add(key)
                # One unwrapped line (Display.warning wraps at the terminal's width), so that it can be grepped.
                self._display.display(f"[WARNING]: Straggler: {text}", color=C.COLOR_WARN, stderr=True)

    def v2_runner_retry(self, result):  # noqa: ANN001
        if result._task.action.split(".")[-1] != "xeonsd_job":
            return
        stop = result._result.get("stop")
        if stop:
            self._display.display(f"  {result._host.get_name()}: {stop.get('message')}", color=C.COLOR_WARN)
        msg = result._result.get("msg")
        # A poll that answered has "finished"; a failed one's message is in xeonsd_console's FAILED line.
        if msg and "finished" in result._result:
            self._display.display(f"  {result._host.get_name()}: {msg}")
        self._warn_stragglers(result)

    def v2_runner_on_ok(self, result):  # noqa: ANN001
        if result._task.action.split(".")[-1] == "xeonsd_job":
            self._warn_stragglers(result)
