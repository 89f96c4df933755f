"""What the finetune role's xeonsd_job module reads from a job's run directory, as plain functions.

Progress comes from the trainer's metrics files; how the job ended from ``exit.json`` (run.sh, through
``xeonsd jobstatus exit``) or Ansible's async results file of the launch; who ended a failed job from the ranks'
status files (``status/rank-<r>.json``, one per rank on its own node, gathered from every node by the role). The
schema of those files is defined once, in the xeonsd package (``xeonsd.cluster.job_status``); this file cannot import the
package (it runs under the node's Ansible Python), so it declares the fields it reads below and
tests/ansible/test_finetune_job.py holds the two together. ``train.log`` (every rank's lines, ``mpirun -l``) is read only
for what people read: the excerpt of the failing ranks' lines, and the count of ranks up while the job starts.
Nothing here imports Ansible, so the tests import it directly; the modules are only the Ansible wrappers.
"""

from __future__ import annotations

import glob
import json
import os
import re
import time

# ---- The contract with the trainer (xeonsd.cluster.job_status); tests/ansible/test_finetune_job.py checks it against the package.
SCHEMA_VERSION = 1
STATUS_DIR = "status"
RANK_STATUS_FIELDS = ("rank", "world", "node", "address", "pid", "state", "step", "updated", "attempt", "error",
                      "schema")  # fmt: skip
ERROR_FIELDS = ("kind", "message", "peer")
EXIT_FIELDS = ("rc", "started", "ended", "attempt", "schema")
STATES = ("starting", "running", "saving", "done", "failed")
ERROR_KINDS = ("input", "exception", "lost_peer", "timeout")
OWN_ERROR_KINDS = ("input", "exception")  # the rank is the cause; lost_peer and timeout: it saw a peer go
LOCK_CONFLICT_RC = 75  # launch.yml's flock --conflict-exit-code: another finetune holds the lock

# ---- The human log (train.log), for the excerpt and the start-up count only: never to decide who failed.
ATTEMPT_MARKER = "#### xeonsd attempt"
METRICS = ("metrics.partial.jsonl", "metrics.jsonl")
_LINE = re.compile(r"^\[(?P<rank>\d+)\] (?P<text>.*)$")
# A rank's line can follow another's progress bar on the same line (tqdm ends its updates with no newline).
_GLUED = re.compile(r"(?<=\S)(?=\[\d+\] )")
# Hydra's word for a node whose MPI proxy went away: in the excerpt, and the lost node when no rank could say.
_DOWNSTREAM = re.compile(r"Downstream from host (?P<addr>\S+) exited abnormally")
# The trainer's start-up line (one per rank once its model is loaded): the "N/M ranks up" of the progress line.
_STARTUP = re.compile(r"\[rank (?P<rank>\d+)/(?P<world>\d+)\].* node=(?P<addr>\S+) pid=(?P<pid>\d+)")
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


def check_rank_status(data: object) -> dict:
    """A rank status as the trainer wrote it, or ValueError saying what is wrong with it."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    where = data.get("file") or f"rank {data.get('rank', '?')}"
    if "problem" in data and "schema" not in data:
        raise ValueError(f"{where}: {data['problem']}")
    if data.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"{where}: schema {data.get('schema')!r}, this role reads schema {SCHEMA_VERSION} (the "
                         "trainer and the playbooks are of different versions)")  # fmt: skip
    missing = [f for f in RANK_STATUS_FIELDS if f not in data]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    if data["state"] not in STATES:
        raise ValueError(f"{where}: state {data['state']!r} is not one of {', '.join(STATES)}")
    error = data["error"]
    if error is not None:
        if not isinstance(error, dict) or any(f not in error for f in ERROR_FIELDS):
            raise ValueError(f"{where}: error {error!r} lacks {', '.join(ERROR_FIELDS)}")
        if error["kind"] not in ERROR_KINDS:
            raise ValueError(f"{where}: error kind {error['kind']!r} is not one of {', '.join(ERROR_KINDS)}")
    return data


def read_status_dir(status_dir: str) -> list[dict]:
    """The rank status files of one node, parsed (not checked: ``diagnose`` does that); a file that is not JSON
    comes back as {"file": path, "problem": why}."""
    found = []
    for path in sorted(glob.glob(os.path.join(status_dir, "rank-*.json"))):
        try:
            with open(path) as fh:
                found.append(json.load(fh))
        except (OSError, ValueError) as exc:
            found.append({"file": path, "problem": f"unreadable ({exc})"})
    return found


def diagnose(statuses: list, nodes: list[dict], ranks_per_node: int, attempt: int | None = None,
             log_text: str = "", excerpt_lines: int = 12) -> dict:  # fmt: skip
    """Which node(s) and rank(s) ended a failed job, from the ranks' status files, with their first log lines.

    ``statuses``: every rank status file found on the nodes (those of an earlier ``attempt`` are ignored). A rank
    with an error of its own (bad input, an exception) is the cause. Otherwise the ranks that failed on a lost
    peer or a collective timeout are witnesses, and the cause is the ranks that fell silent (no error, not done)
    on the nodes the witnesses name as the peer that went away (when none could report before mpirun ended them,
    on the node Hydra reports it lost), or else simply the silent ones. ``log_text`` (train.log) otherwise only
    gives the excerpt: the failing ranks' own lines.
    """
    problems: list[str] = []
    current: dict[int, dict] = {}
    for entry in statuses:
        try:
            status = check_rank_status(entry)
        except ValueError as exc:
            problems.append(f"status file {exc}")
            continue
        if attempt is not None and status["attempt"] != attempt:
            continue  # left by an earlier attempt of this run
        seen = current.get(status["rank"])
        if seen is None or status["updated"] >= seen["updated"]:
            current[status["rank"]] = status
    world = max((s["world"] for s in current.values()), default=0) or ranks_per_node * len(nodes)
    by_addr = {n["address"]: n["name"] for n in nodes}

    def node_of(rank: int) -> str:
        if rank in current:
            return by_addr.get(current[rank]["address"], current[rank]["node"])
        index = rank // max(1, ranks_per_node)
        return nodes[index]["name"] if index < len(nodes) else "?"

    def failed(kinds: tuple[str, ...]) -> dict[int, dict]:
        return {r: s["error"] for r, s in sorted(current.items())
                if s["state"] == "failed" and s["error"] and s["error"]["kind"] in kinds}  # fmt: skip

    text = last_attempt(log_text)
    lines = rank_lines(text)
    own_errors = failed(OWN_ERROR_KINDS)
    witnesses = failed(tuple(k for k in ERROR_KINDS if k not in OWN_ERROR_KINDS))
    if own_errors:
        culprits = sorted(own_errors)
        kind = "failed with an error"
    elif current:
        silent = [r for r in range(world) if r not in witnesses and current.get(r, {}).get("state") != "done"]
        named = {by_addr.get(e["peer"], e["peer"]) for e in witnesses.values() if e.get("peer")}
        if not named:  # mpirun ended every rank before one could report: Hydra's own word for the node it lost
            named = {by_addr.get(m["addr"], m["addr"]) for m in _DOWNSTREAM.finditer(text)}
        culprits = [r for r in silent if node_of(r) in named] or silent
        kind = "stopped without an error of their own (killed, crashed hard or stalled; or their node went away)"
    else:
        culprits = []
        kind = "no rank of this attempt wrote its status file (the job did not start: see its log)"
    order = [n["name"] for n in nodes]
    bad_nodes = sorted({node_of(r) for r in culprits}, key=lambda n: order.index(n) if n in order else len(order))
    excerpt: list[str] = []
    if own_errors:
        for rank in culprits:
            own = lines.get(rank, [])
            first = next((i for i, ln in enumerate(own) if "error" in ln.lower() or ln.startswith("Traceback")), None)
            if first is None:  # its lines are not in the log (or there is no log): what its status file says
                excerpt.append(f"[rank {rank}] {own_errors[rank]['kind']}: {own_errors[rank]['message'][:400]}")
            else:
                excerpt += [f"[rank {rank}] {ln[:400]}" for ln in own[first : first + excerpt_lines]]
            if len(excerpt) >= excerpt_lines:
                break
    elif current:
        # Ranks that died silently: the last line each printed, what their peers saw, and what mpirun saw.
        excerpt += [
            f"[rank {r}] last line: {lines[r][-1][:300]}" for r in culprits[: excerpt_lines // 2] if lines.get(r)
        ]
        excerpt += [f"[rank {r}] {witnesses[r]['message'][:600]}" for r in sorted(witnesses)[:2]]
        excerpt += [m.group(0) for m in _DOWNSTREAM.finditer(text)][:2]
    else:
        excerpt = [ln[:400] for ln in text.splitlines()[-excerpt_lines:]]
    parts = []
    for node in bad_nodes:
        mine = [r for r in culprits if node_of(r) == node]
        parts.append(f"{node} (rank{'s' if len(mine) > 1 else ''} {_compress(mine)})")
    summary = f"{', '.join(parts) or 'unknown node'}: {kind}"
    if not own_errors and witnesses:
        summary += f"; {len(witnesses)} other rank(s) reported losing them"
    if problems:
        summary += f"; {len(problems)} status file(s) could not be read"
    return {
        "nodes": bad_nodes,
        "ranks": culprits,
        "summary": summary,
        "excerpt": excerpt[: excerpt_lines + 1] + problems[:2],
    }


def read_exit(run_dir: str) -> dict | None:
    """run.sh's exit.json (``xeonsd jobstatus exit``), checked; None when there is none."""
    path = os.path.join(run_dir, "exit.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as fh:
            data = json.load(fh)
    except ValueError as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from exc
    if not isinstance(data, dict) or data.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema {data.get('schema') if isinstance(data, dict) else None!r}, this role "
                         f"reads schema {SCHEMA_VERSION} (the trainer and the playbooks are of different versions)")  # fmt: skip
    missing = [f for f in EXIT_FIELDS if f not in data]
    if missing:
        raise ValueError(f"{path}: missing field(s) {', '.join(missing)}")
    return data


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
    """The poll's answer. ``params["rank_status"]``: the status files gathered from every node (None: this
    node's own ``status/`` directory, all of them on a one-node cluster)."""
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
    if launch["finished"]:
        exit_info = read_exit(run_dir) or {}
        result["exit"] = exit_info
        rc = exit_info.get("rc", launch.get("rc"))
        if rc is None:
            rc = 124 if _TIMEOUT.search(str(launch.get("msg", ""))) else 1
        result["exit_code"] = rc
        if rc == LOCK_CONFLICT_RC:
            result["failure"] = {"nodes": [], "ranks": [], "excerpt": [],
                                 "summary": "another finetune holds the lock on the primary; it was not started twice"}  # fmt: skip
        elif rc != 0:
            statuses = params.get("rank_status")
            if statuses is None:
                statuses = read_status_dir(os.path.join(run_dir, STATUS_DIR))
            failure = diagnose(statuses, params["nodes"], params["ranks_per_node"], exit_info.get("attempt"),
                               log_text, params["excerpt_lines"])  # fmt: skip
            if rc == 124 or _JOB_TIMEOUT in attempt:
                failure["summary"] = f"the job ran past its time limit; {failure['summary']}"
            result["failure"] = failure
        result["msg"] = f"finished (rc {rc}) · " + result["msg"]
    result["checked_at"] = time.time()
    return result
