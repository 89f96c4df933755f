"""The top of ``report.html``: the status line (done, stopped or failed; steps; the training job's wall time;
images/s; cost) and, for a run told to stop, by what, at which step and how to resume (:mod:`.report`)."""

from __future__ import annotations

import dataclasses
import html
import statistics
from pathlib import Path

from xeonsd.contracts.job_status import ExitStatus, StatusFileError, read_exit
from xeonsd.contracts.run_files import TRAINING_WALL
from xeonsd.jobs.watch import stop_summary


def ended_attempt(run: Path) -> ExitStatus | None:
    """exit.json of the run's last attempt; None when there is none or it cannot be read."""
    try:
        return read_exit(run)
    except (OSError, StatusFileError):
        return None


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


def outcome(run: Path, ended: ExitStatus | None, rows: list[dict]) -> str:
    """done, stopped, failed (exit code N), not finished (a run with partial metrics only) or not trained."""
    if ended is not None:
        if ended.stopped is not None:
            return "stopped"
        return "done" if ended.rc == 0 else f"failed (exit code {ended.rc})"
    if (run / "metrics.jsonl").is_file():
        return "done"
    return "not finished" if rows else "not trained"


def status_line(run: Path, ended: ExitStatus | None, info: dict, rows: list[dict], figs: dict) -> str:
    """The outcome, the steps, the training job's wall time, images/s and the cost, in one line."""
    state = outcome(run, ended, rows)
    parts = [f"<b class=state>{html.escape(state.capitalize())}</b>"]
    if rows:
        parts.append(f"{rows[-1]['step']} steps")
        wall = (info.get("phases") or {}).get(TRAINING_WALL)
        parts.append(
            f"{_duration(float(wall))} training wall time"
            if wall
            else f"{_duration(sum(r['s_per_step'] for r in rows))} in the steps"
        )
        ips = statistics.median(r["images_per_s"] for r in rows[1:] or rows)
        parts.append(f"{ips:.3g} images/s in training")
    cost = figs.get("cost") or {}
    if cost:
        parts.append(
            f"cost {cost['training_cost']:.4g} {html.escape(cost['currency'])} ({cost['node_hours']:.3g} node-hours)"
        )
    else:
        parts.append("cost: no node_hour_price set")
    css = "done" if state == "done" else "stopped" if state == "stopped" else "failed"
    return f"<p class='status {css}'>{' · '.join(parts)}</p>"


def stopped_section(ended: ExitStatus | None) -> list[str]:
    """The last attempt stopped as it was told to (SIGTERM, the time limit, …): by what, where, how to resume."""
    if ended is None or ended.stopped is None:
        return []
    text = stop_summary(dataclasses.asdict(ended.stopped))
    return [f"<h2>Stopped</h2><p>Attempt {ended.attempt or '?'} {html.escape(text)} (exit code {ended.rc}).</p>"]
