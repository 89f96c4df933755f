"""What the finetune role's xeonsd_job module reads from a job's run directory, as plain functions.

Progress comes from the trainer's metrics files, the failure diagnosis from ``train.log`` (mpirun -l output of every
rank, one attempt per header line), the exit code from ``exit.json`` (run.sh) or Ansible's async results file of the
launch. Nothing here imports Ansible, so the tests import it directly; the module is only the Ansible wrapper.
"""

from __future__ import annotations

import json
import os
import re
import time

ATTEMPT_MARKER = "#### xeonsd attempt"
METRICS = ("metrics.partial.jsonl", "metrics.jsonl")
_LINE = re.compile(r"^\[(?P<rank>\d+)\] (?P<text>.*)$")
# A rank's line can follow another's progress bar on the same line (tqdm ends its updates with no newline).
_GLUED = re.compile(r"(?<=\S)(?=\[\d+\] )")
# Hydra's word for a node whose MPI proxy went away.
_DOWNSTREAM = re.compile(r"Downstream from host (?P<addr>\S+) exited abnormally")
_STARTUP = re.compile(r"\[rank (?P<rank>\d+)/(?P<world>\d+)\].* node=(?P<addr>\S+) pid=(?P<pid>\d+)")
_FATAL = re.compile(r"xeonsd train: error: (?:rank (?P<rank>\d+)/(?P<world>\d+) on (?P<addr>\S+?):? )?(?P<msg>.*)")
_LOST_PEER = "a peer rank died"
_PEER_ADDR = re.compile(r"\[(?P<addr>\d{1,3}(?:\.\d{1,3}){3})\]:\d+")
_TIMEOUT = re.compile(r"timed? ?out|Timeout exceeded", re.IGNORECASE)
# What Intel MPI prints when I_MPI_JOB_TIMEOUT ends the job.
_JOB_TIMEOUT = "job ending due to application timeout"


def last_attempt(log_text: str) -> str:
    """The part of train.log written by the newest attempt (a resumed run appends to the same log)."""
    cut = log_text.rfind(ATTEMPT_MARKER)
    return log_text[cut:] if cut >= 0 else log_text


def rank_lines(log_text: str) -> dict[int, list[str]]:
    """Each rank's own lines (mpirun -l prefixes every line with [rank]; tqdm's carriage returns split too)."""
    lines: dict[int, list[str]] = {}
    for raw in _GLUED.sub("\n", log_text.replace("\r", "\n")).splitlines():
        m = _LINE.match(raw.strip())
        if m and m["text"].strip():
            lines.setdefault(int(m["rank"]), []).append(m["text"].rstrip())
    return lines


def read_progress(run_dir: str, total: int) -> dict:
    rows = []
    for name in METRICS:
        path = os.path.join(run_dir, name)
        if os.path.isfile(path):
            with open(path) as fh:
                for line in fh:
                    try:
                        rows.append(json.loads(line))
                    except ValueError:
                        continue  # a line being written right now
            break
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
        f"{straggler['node']} (rank{'s' if len(straggler['ranks']) > 1 else ''} {_compress(straggler['ranks'])}) "
        f"is a straggler that holds every rank back at each all-reduce: {'; '.join(straggler['why'])}. "
        f"Likely causes, most likely first: {causes}. The job keeps running."
    )


def _compress(ranks: list[int]) -> str:
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


def diagnose(log_text: str, nodes: list[dict], ranks_per_node: int, excerpt_lines: int = 12) -> dict:
    """Which node(s) and rank(s) ended a failed job, and the first lines of their log.

    A rank with an error of its own (bad input, a traceback) is the cause. Otherwise the ranks that reported
    losing a peer are witnesses, and the cause is the node whose ranks fell silent and that the witnesses name
    as the peer that went away (or, after a stall, simply the silent node).
    """
    text = last_attempt(log_text)
    lines = rank_lines(text)
    addr_of: dict[int, str] = {}
    world = None
    for rank, own in lines.items():
        for line in own:
            m = _STARTUP.search(line)
            if m:
                addr_of[rank] = m["addr"]
                world = int(m["world"])
    own_errors: dict[int, str] = {}
    lost_peer: dict[int, str] = {}
    for rank, own in lines.items():
        for line in own:
            m = _FATAL.search(line)
            if m:
                world = world or (int(m["world"]) if m["world"] else None)
                if m["addr"]:
                    addr_of.setdefault(rank, m["addr"])
                (lost_peer if _LOST_PEER in line else own_errors).setdefault(rank, line)
            elif line.startswith("Traceback"):
                own_errors.setdefault(rank, line)
    world = world or (max(lines) + 1 if lines else 0)
    by_addr = {n["address"]: n["name"] for n in nodes}

    def node_of(rank: int) -> str:
        if rank in addr_of:
            return by_addr.get(addr_of[rank], addr_of[rank])
        index = rank // max(1, ranks_per_node)
        return nodes[index]["name"] if index < len(nodes) else "?"

    if own_errors:
        culprits = sorted(own_errors)
        kind = "failed with an error"
    else:
        silent = [r for r in range(world) if r not in lost_peer]
        named = {by_addr.get(m["addr"], m["addr"]) for line in lost_peer.values() for m in _PEER_ADDR.finditer(line)}
        named |= {by_addr.get(m["addr"], m["addr"]) for m in _DOWNSTREAM.finditer(text)}
        culprits = [r for r in silent if node_of(r) in named] or silent
        kind = "stopped without an error of their own (killed, crashed hard or stalled; or their node went away)"
    order = [n["name"] for n in nodes]
    bad_nodes = sorted({node_of(r) for r in culprits}, key=lambda n: order.index(n) if n in order else len(order))
    excerpt: list[str] = []
    if own_errors:
        for rank in culprits:
            own = lines.get(rank, [])
            first = next(i for i, ln in enumerate(own) if "error" in ln.lower() or ln.startswith("Traceback"))
            excerpt += [f"[rank {rank}] {ln[:400]}" for ln in own[first : first + excerpt_lines]]
            if len(excerpt) >= excerpt_lines:
                break
    else:
        # Ranks that died silently: the last line each printed, what their peers saw, and what mpirun saw.
        excerpt += [
            f"[rank {r}] last line: {lines[r][-1][:300]}" for r in culprits[: excerpt_lines // 2] if lines.get(r)
        ]
        excerpt += [f"[rank {r}] {lost_peer[r][:600]}" for r in sorted(lost_peer)[:2]]
        excerpt += [m.group(0) for m in _DOWNSTREAM.finditer(text)][:2]
    if not lines:
        excerpt = [ln[:400] for ln in text.splitlines()[-excerpt_lines:]]
    parts = []
    for node in bad_nodes:
        mine = [r for r in culprits if node_of(r) == node]
        parts.append(f"{node} (rank{'s' if len(mine) > 1 else ''} {_compress(mine)})")
    summary = f"{', '.join(parts) or 'unknown node'}: {kind}"
    if not own_errors and lost_peer:
        summary += f"; {len(lost_peer)} other rank(s) reported losing them"
    return {"nodes": bad_nodes, "ranks": culprits, "summary": summary, "excerpt": excerpt[: excerpt_lines + 1]}


def async_state(results_file: str) -> dict:
    """Ansible's async results: {"finished": bool, ...} (the same rules as async_status)."""
    try:
        with open(results_file) as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return {"finished": False}
    except ValueError:
        return {"finished": False}  # being written
    if "started" not in data:
        data["finished"] = True
    else:
        data["finished"] = bool(data.get("finished"))
    return data


def job_state(params: dict) -> dict:
    run_dir = params["run_dir"]
    total = params["total_steps"]
    launch = async_state(params["results_file"])
    progress = read_progress(run_dir, total)
    log_path = os.path.join(run_dir, "train.log")
    log_text = ""
    if os.path.isfile(log_path):
        with open(log_path, errors="replace") as fh:
            log_text = fh.read()
    attempt = last_attempt(log_text)
    ranks_up = len(set(m["rank"] for m in _STARTUP.finditer(attempt)))
    world = params["ranks_per_node"] * len(params["nodes"]) if params["nodes"] else None
    result = {
        "changed": False,
        "finished": launch["finished"],
        # Not "rc": Ansible marks any result whose rc is non-zero as a failed task, and the poll itself did not fail.
        "exit_code": None,
        "progress": progress,
        "msg": progress_line(progress, ranks_up, world),
        # One line per straggler node; the xeonsd_progress callback prints each node's once.
        "straggler_warnings": {s["node"]: straggler_warning(s) for s in progress.get("stragglers", [])},
    }
    exit_path = os.path.join(run_dir, "exit.json")
    if launch["finished"]:
        exit_info = {}
        if os.path.isfile(exit_path):
            with open(exit_path) as fh:
                exit_info = json.load(fh)
        result["exit"] = exit_info
        rc = exit_info.get("rc", launch.get("rc"))
        if rc is None:
            rc = 124 if _TIMEOUT.search(str(launch.get("msg", ""))) else 1
        result["exit_code"] = rc
        if rc == 75:
            result["failure"] = {"nodes": [], "ranks": [], "excerpt": [],
                                 "summary": "another finetune holds the lock on the primary; it was not started twice"}  # fmt: skip
        elif rc != 0:
            failure = diagnose(log_text, params["nodes"], params["ranks_per_node"], params["excerpt_lines"])
            if rc == 124 or _JOB_TIMEOUT in attempt:
                failure["summary"] = f"the job ran past its time limit; {failure['summary']}"
            result["failure"] = failure
        result["msg"] = f"finished (rc {rc}) · " + result["msg"]
    result["checked_at"] = time.time()
    return result
