"""Run the real playbooks through ansible-runner and read what happened as data: per-host stats and task events.

The playbook runs exactly as a user runs it (``ansible-playbook -i INVENTORY PLAYBOOK ARGS`` from the repository
root, with the repository's ansible.cfg, its callbacks and its fact cache); ansible-runner adds its event callback
beside ours, so the tests assert on which task failed on which host and with what message instead of parsing text.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import ansible_runner
from timings import TIMINGS

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


# ansible-runner's names for the PLAY RECAP columns.
_STATS = {
    "ok": "ok",
    "changed": "changed",
    "dark": "unreachable",
    "failures": "failed",
    "skipped": "skipped",
    "rescued": "rescued",
    "ignored": "ignored",
}


@dataclass(frozen=True)
class TaskFailure:
    """A task that failed (or could not reach its host) and was not ignored."""

    host: str
    task: str  # the task's name, e.g. "preflight : Refuse an offline install that would download"
    msg: str

    def __str__(self) -> str:
        return f"{self.host}: {self.task}: {self.msg}"


@dataclass
class PlaybookRun:
    argv: list[str]
    rc: int
    output: str
    seconds: float
    log: Path
    events: list[dict] = field(default_factory=list)

    @property
    def recap(self) -> dict[str, dict[str, int]]:
        """{host: {"ok": n, "changed": n, "unreachable": n, "failed": n, ...}}: the PLAY RECAP, from the stats event."""
        stats = next((e["event_data"] for e in reversed(self.events) if e.get("event") == "playbook_on_stats"), None)
        if stats is None:
            return {}
        hosts = set().union(*(stats.get(key) or {} for key in (*_STATS, "processed")))
        return {h: {name: int((stats.get(key) or {}).get(h, 0)) for key, name in _STATS.items()} for h in sorted(hosts)}

    def changed(self) -> dict[str, int]:
        return {h: c["changed"] for h, c in self.recap.items()}

    def failures(self) -> list[TaskFailure]:
        """Every task that failed on a host (ignore_errors excluded) or found it unreachable, in order."""
        out = []
        for e in self.events:
            data = e.get("event_data", {})
            failed = e.get("event") == "runner_on_failed" and not data.get("ignore_errors")
            if failed or e.get("event") == "runner_on_unreachable":
                task = data.get("task", "?")
                if data.get("role"):
                    task = f"{data['role']} : {task}"  # the role's short name (Ansible shows xeonsd.cluster.<role>)
                out.append(TaskFailure(data.get("host", "?"), task, _message(data.get("res") or {})))
        return out

    def plays(self) -> list[str]:
        """The names of the plays that started, in order."""
        return [e["event_data"].get("name", "") for e in self.events if e.get("event") == "playbook_on_play_start"]

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


def _message(res: dict) -> str:
    """A failed result's message; for a loop, the messages of the items that failed (not "One or more items
    failed")."""
    items = [r for r in res.get("results") or [] if isinstance(r, dict) and r.get("failed")]
    parts = [_message(r) for r in items] if items else [res.get("msg") or res.get("stderr") or res.get("module_stderr")]
    return " ".join(" ".join(str(p).split()) for p in parts if p)


def ansible_env(state_dir: Path) -> dict[str, str]:
    """The environment of a user's run from the repository root, plus the test cluster's own fact cache."""
    env = dict(os.environ)
    env.update(
        ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
        # The test cluster's own fact cache, so its facts never mix with a real cluster's.
        ANSIBLE_CACHE_PLUGIN_CONNECTION=str(state_dir / "facts"),
        PYTHONUNBUFFERED="1",
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
    )
    return env


def _runner_env(state_dir: Path) -> dict[str, str]:
    """What ansible-runner would otherwise change from the repository's ansible.cfg: our callbacks stay loaded
    (it appends its own directory to this path) and host keys stay checked (it turns checking off when unset)."""
    return {
        **ansible_env(state_dir),
        "ANSIBLE_CALLBACK_PLUGINS": str(REPO / "plugins" / "callback"),
        "ANSIBLE_HOST_KEY_CHECKING": "True",
    }


def run_playbook(
    playbook: str, inventory: Path, *args: str, state_dir: Path, name: str, timeout: float = 3600
) -> PlaybookRun:
    """ansible-playbook -i INVENTORY PLAYBOOK ARGS from the repository root; the output goes to a log file and the
    events to ``state_dir/runner/NAME``."""
    argv = [str(VENV_BIN / "ansible-playbook"), "-i", str(inventory), playbook, *args]
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    private = state_dir / "runner" / name
    shutil.rmtree(private, ignore_errors=True)
    private.mkdir(parents=True)
    began = time.monotonic()
    run = ansible_runner.run(
        private_data_dir=str(private),
        project_dir=str(REPO),
        playbook=playbook,
        inventory=str(inventory),
        cmdline=shlex.join(args),
        envvars=_runner_env(state_dir),
        fact_cache=str(state_dir / "facts"),  # an absolute path: the cache every run of this cluster shares
        suppress_env_files=True,
        quiet=True,
        timeout=int(timeout),
    )
    seconds = time.monotonic() - began
    with run.stdout as fh:
        output = fh.read().replace("\r\n", "\n")
    log.write_text(output)
    TIMINGS.append((name, seconds))
    if run.status == "timeout":
        raise TimeoutError(f"{' '.join(argv)} ran past {timeout:.0f} s; its output is in {log}")
    return PlaybookRun(argv=argv, rc=run.rc, output=output, seconds=seconds, log=log, events=list(run.events))
