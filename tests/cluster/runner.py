"""Run the real playbooks with ansible-playbook and read their PLAY RECAP."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent

# (log name, wall seconds) of every playbook run in this session, for the summary at the end.
TIMINGS: list[tuple[str, float]] = []

RECAP_LINE = re.compile(r"^(?P<host>\S+)\s*:\s*(?P<counts>(?:\w+=\d+\s*)+)$")


@dataclass
class PlaybookRun:
    argv: list[str]
    rc: int
    output: str
    seconds: float
    log: Path

    @property
    def recap(self) -> dict[str, dict[str, int]]:
        """{host: {"ok": n, "changed": n, "unreachable": n, "failed": n, ...}} from the PLAY RECAP."""
        text = self.output.split("PLAY RECAP", 1)[-1] if "PLAY RECAP" in self.output else ""
        hosts = {}
        for line in text.splitlines()[1:]:
            m = RECAP_LINE.match(line.strip())
            if m:
                hosts[m["host"]] = {k: int(v) for k, v in (kv.split("=") for kv in m["counts"].split())}
            elif hosts and line.strip() == "":
                break
        return hosts

    def changed(self) -> dict[str, int]:
        return {h: c["changed"] for h, c in self.recap.items()}

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


def ansible_env(state_dir: Path) -> dict[str, str]:
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


def run_playbook(
    playbook: str, inventory: Path, *args: str, state_dir: Path, name: str, timeout: float = 3600
) -> PlaybookRun:
    """ansible-playbook -i INVENTORY PLAYBOOK ARGS from the repository root; the output goes to a log file."""
    argv = [str(VENV_BIN / "ansible-playbook"), "-i", str(inventory), playbook, *args]
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    began = time.monotonic()
    proc = subprocess.run(
        argv,
        cwd=REPO,
        env=ansible_env(state_dir),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=timeout,
    )
    seconds = time.monotonic() - began
    log.write_text(proc.stdout)
    TIMINGS.append((name, seconds))
    return PlaybookRun(argv=argv, rc=proc.returncode, output=proc.stdout, seconds=seconds, log=log)
