"""The progress line the finetune role prints on every poll, from the trainer's metrics files: step, loss, s/step,
time left, the ranks' CPU use, a straggler warning, and the layout verdict when every node is low on CPU. Read on
the node by :mod:`.watch`."""

from __future__ import annotations

import json
from pathlib import Path

METRICS = ("metrics.partial.jsonl", "metrics.jsonl")


def metrics_rows(run_dir: str | Path, names: tuple[str, ...] = METRICS) -> list[dict]:
    """The rows of the first of the metrics files ``names`` in ``run_dir`` that exists (none: []); a line that is
    not JSON (being written right now, or cut short by a crash) is skipped."""
    for name in names:
        path = Path(run_dir) / name
        if path.is_file():
            rows = []
            for line in path.read_text().splitlines():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue
            return rows
    return []


def read_progress(run_dir: str | Path, total: int) -> dict:
    rows = metrics_rows(run_dir)
    if not rows:
        return {"step": 0, "total": total}
    last = rows[-1]
    recent = sorted(r["s_per_step"] for r in rows[-20:])
    s_per_step = recent[len(recent) // 2]
    gathered = [r for r in rows if r.get("rank_stats")]
    stragglers: dict[str, dict] = {}
    for row in gathered:  # the newest verdict for each node the trainer flagged
        for s in row.get("stragglers") or []:
            stragglers[s["node"]] = s
    layouts = [r["layout_verdict"] for r in gathered if r.get("layout_verdict")]
    return {
        "step": last["step"],
        "total": total,
        "loss": last["loss"],
        "s_per_step": s_per_step,
        "eta_s": max(0.0, (total - last["step"]) * s_per_step),
        "ranks": last.get("ranks"),
        "backend": last.get("backend"),
        "rank_stats": gathered[-1]["rank_stats"] if gathered else None,
        "stragglers": list(stragglers.values()),
        # Every node low on CPU: the layout or the shared load, said once (the newest figures), not per node.
        "layout_verdict": layouts[-1] if layouts else None,
    }


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m {seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def progress_line(progress: dict, ranks_up: int, world: int | None) -> str:
    if progress["step"] == 0:
        up = f"{ranks_up}/{world}" if world else str(ranks_up)
        return f"starting: {up} ranks up, step 0/{progress['total']}"
    if progress["step"] >= progress["total"]:
        pct, left = "100%", "saving the outputs"
    else:
        pct = f"{100 * progress['step'] / max(1, progress['total']):.0f}%"
        left = f"~{_duration(progress['eta_s'])} left"
    return (
        f"step {progress['step']}/{progress['total']} ({pct}) · loss {progress['loss']:.4f} · "
        f"{progress['s_per_step']:.2f} s/step · {left} · {progress['ranks']} ranks ({progress['backend']})"
        + "".join(f" · {part}" for part in cpu_parts(progress.get("rank_stats")))
    )


def cpu_parts(stats: dict | None) -> list[str]:
    """'cpu 96 % (lowest node3 71 %)' and 'slowest node3 compute 2.95 s vs median 2.10 s' from the trainer's
    newest gathered rank statistics (metrics.jsonl's ``rank_stats``)."""
    if not stats:
        return []
    parts = [
        f"cpu {100 * stats['cpu_util']:.0f} % (lowest {stats['lowest_node']} {100 * stats['lowest_cpu_util']:.0f} %)"
    ]
    if len(stats.get("nodes", [])) > 1:
        parts.append(
            f"slowest {stats['slowest_node']} compute {stats['slowest_compute_s']:.2f} s vs median "
            f"{stats['median_compute_s']:.2f} s"
        )
    return parts


def straggler_warning(straggler: dict) -> str:
    """One warning for a node the trainer flagged: the node, its ranks, why, and the likely causes in order."""
    causes = " ".join(f"({i}) {c};" for i, c in enumerate(straggler["causes"], 1)).rstrip(";")
    return (
        f"{straggler['node']} (rank{'s' if len(straggler['ranks']) > 1 else ''} {compress_ranks(straggler['ranks'])}) "
        f"is a straggler that holds every rank back at each all-reduce: {'; '.join(straggler['why'])}. "
        f"Likely causes, most likely first: {causes}. The job keeps running."
    )


def compress_ranks(ranks: list[int]) -> str:
    """[8, 9, 10, 11, 13] -> '8-11, 13'"""
    out, run = [], []
    for r in sorted(ranks):
        if run and r != run[-1] + 1:
            out.append(run)
            run = []
        run.append(r)
    if run:
        out.append(run)
    return ", ".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in out)
