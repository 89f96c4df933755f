"""The wall times of the playbook runs of one test session (fresh provision, second run, ...): figures, not
assertions. The cluster tests append to TIMINGS; the session leaves them in PLAYBOOK_TIMES, which the root
conftest prints at the end of the run (under pytest-xdist the cluster tests run in a worker process, the summary in
the controller)."""

from __future__ import annotations

import json
import os
from pathlib import Path

TIMINGS: list[tuple[str, float]] = []
PLAYBOOK_TIMES = (
    Path(__file__).resolve().parents[2]
    / ".cluster"
    / f"playbook-times-{os.environ.get('XEONSD_TEST_CLUSTER_SLOT', '1')}.json"
)


def save() -> None:
    if TIMINGS:
        PLAYBOOK_TIMES.parent.mkdir(parents=True, exist_ok=True)
        PLAYBOOK_TIMES.write_text(json.dumps(TIMINGS))


def load_and_clear() -> list[tuple[str, float]]:
    """This session's figures, once: the file is removed, so that the next session does not print them again."""
    try:
        rows = json.loads(PLAYBOOK_TIMES.read_text())
    except FileNotFoundError:
        return []
    PLAYBOOK_TIMES.unlink()
    return [(name, seconds) for name, seconds in rows]
