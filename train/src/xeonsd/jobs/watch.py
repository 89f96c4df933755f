"""What the finetune role reads of a job while it runs and once it ended: the progress line, which node(s) and
rank(s) ended a failed job, and how a job that was told to stop stopped (signal, step, checkpoint). The role's
``xeonsd_job`` and ``xeonsd_rank_status`` modules run this on the node, in its diffuser env (``xeonsd jobstatus
poll`` / ``xeonsd jobstatus ranks``, JSON on stdout: :mod:`.cli`), so the files are read through their schema
(:mod:`xeonsd.contracts.job_status`) by the package that writes them, and nowhere else.

Progress comes from the trainer's metrics files; how the job ended from ``exit.json`` (run.sh, through
``xeonsd jobstatus exit``) or Ansible's async results file of the launch; who ended a failed job from the ranks'
status files (``status/rank-<r>.json``, one per rank on its own node, gathered from every node by the role).
``train.log`` (every rank's lines, ``mpirun -l``; this attempt's part starts at attempt.json's ``log_offset``) is
read only for what people read: the excerpt of the failing ranks' lines and Hydra's word for a lost node, and the
count of ranks up while the job starts.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import time
from pathlib import Path

from xeonsd.contracts.job_status import (
    ERROR_KINDS,
    LOCK_CONFLICT_RC,
    LOG_FILE,
    OWN_ERROR_KINDS,
    STATUS_DIR,
    StatusFileError,
    rank_status_from_dict,
    read_attempt,
    read_exit,
)
from xeonsd.contracts.slurm_job import read_slurm_job
from xeonsd.jobs.progress import compress_ranks, progress_line, read_progress, straggler_warning

# Ansible's async results when the launch itself ran past its async limit.
ASYNC_TIMEOUT_RC = 124
_LINE = re.compile(r"^\[(?P<rank>\d+)\] (?P<text>.*)$")
# A rank's line can follow another's progress bar on the same line (tqdm ends its updates with no newline).
_GLUED = re.compile(r"(?<=\S)(?=\[\d+\] )")
# Hydra's word for a node whose MPI proxy went away: in the excerpt, and the lost node when no rank could say.
_DOWNSTREAM = re.compile(r"Downstream from host (?P<addr>\S+) exited abnormally")
# srun's word for the tasks that ended first (under Slurm; --kill-on-bad-exit then ends the others, whose lines
# follow): the lost node when no rank could say.
_SRUN_ENDED = re.compile(r"^srun: error: (?P<node>[^:\s]+): tasks? [\d,\-]+: .*$", re.MULTILINE)
# The trainer's start-up line (one per rank once its model is loaded, trainer/loop.py's setup): the "N/M ranks up"
# of the progress line. The primary sees only its own node's status files while the job runs; train.log has every
# rank's lines.
STARTUP = re.compile(r"\[rank (?P<rank>\d+)/(?P<world>\d+)\].* node=(?P<addr>\S+) pid=(?P<pid>\d+)")
_ASYNC_TIMEOUT = re.compile(r"timed? ?out|Timeout exceeded", re.IGNORECASE)


def ranks_up(log_text: str) -> int:
    """How many ranks of this attempt logged their start-up line."""
    return len({m["rank"] for m in STARTUP.finditer(log_text)})


def rank_lines(log_text: str) -> dict[int, list[str]]:
    """Each rank's own lines (mpirun -l prefixes every line with [rank]; tqdm's carriage returns split too)."""
    lines: dict[int, list[str]] = {}
    for raw in _GLUED.sub("\n", log_text.replace("\r", "\n")).splitlines():
        m = _LINE.match(raw.strip())
        if m and m["text"].strip():
            lines.setdefault(int(m["rank"]), []).append(m["text"].rstrip())
    return lines


def attempt_log(run_dir: str | Path) -> str:
    """The part of train.log written by the current attempt (a resumed run appends to the same log): from the
    offset ``xeonsd jobstatus begin`` recorded in attempt.json."""
    path = Path(run_dir) / LOG_FILE
    if not path.is_file():
        return ""
    attempt = read_attempt(run_dir)
    with open(path, "rb") as fh:
        fh.seek(attempt.log_offset if attempt else 0)
        return fh.read().decode(errors="replace")


# ---- the ranks' status files, as the role gathers them from every node ------------------------------------------


def read_status_dir(status_dir: str | Path) -> list[dict]:
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


def check_rank_status(data: object) -> dict:
    """A rank status as the trainer wrote it (job_status's schema), or StatusFileError saying what is wrong."""
    if not isinstance(data, dict):
        raise StatusFileError(f"expected a JSON object, got {type(data).__name__}")
    where = data.get("file") or f"rank {data.get('rank', '?')}"
    if "problem" in data and "schema" not in data:
        raise StatusFileError(f"{where}: {data['problem']}")
    return dataclasses.asdict(rank_status_from_dict(data, where))


def _current(statuses: list, attempt: int | None) -> tuple[dict[int, dict], list[str]]:
    """The newest status of each rank of this attempt, and what could not be read."""
    problems: list[str] = []
    current: dict[int, dict] = {}
    for entry in statuses:
        try:
            status = check_rank_status(entry)
        except StatusFileError as exc:
            problems.append(f"status file {exc}")
            continue
        if attempt is not None and status["attempt"] != attempt:
            continue  # left by an earlier attempt of this run
        seen = current.get(status["rank"])
        if seen is None or status["updated"] >= seen["updated"]:
            current[status["rank"]] = status
    return current, problems


@dataclasses.dataclass
class _Verdict:
    """Who ended the job: the ranks to blame (``culprits``), and which ranks had an error of their own or saw
    a peer go (``own``, ``witnesses``: rank -> its error)."""

    culprits: list[int]
    kind: str
    own: dict[int, dict]
    witnesses: dict[int, dict]


def _verdict(current: dict[int, dict], world: int, by_addr: dict[str, str], node_of, text: str) -> _Verdict:
    def failed(kinds: tuple[str, ...]) -> dict[int, dict]:
        return {
            r: s["error"]
            for r, s in sorted(current.items())
            if s["state"] == "failed" and s["error"] and s["error"]["kind"] in kinds
        }

    own = failed(OWN_ERROR_KINDS)
    witnesses = failed(tuple(k for k in ERROR_KINDS if k not in OWN_ERROR_KINDS))
    if own:
        return _Verdict(sorted(own), "failed with an error", own, witnesses)
    if not current:
        kind = "no rank of this attempt wrote its status file (the job did not start: see its log)"
        return _Verdict([], kind, own, witnesses)
    silent = [r for r in range(world) if r not in witnesses and current.get(r, {}).get("state") != "done"]
    named = {by_addr.get(e["peer"], e["peer"]) for e in witnesses.values() if e.get("peer")}
    if not named:  # mpirun ended every rank before one could report: Hydra's own word for the node it lost
        named = {by_addr.get(m["addr"], m["addr"]) for m in _DOWNSTREAM.finditer(text)}
    if not named and (first := _SRUN_ENDED.search(text)):  # srun's, under Slurm: the first node it reports
        named = {first["node"]}
    culprits = [r for r in silent if node_of(r) in named] or silent
    kind = "stopped without an error of their own (killed, crashed hard or stalled; or their node went away)"
    return _Verdict(culprits, kind, own, witnesses)


def _excerpt(verdict: _Verdict, any_status: bool, text: str, excerpt_lines: int) -> list[str]:
    lines = rank_lines(text)
    excerpt: list[str] = []
    if verdict.own:
        for rank in verdict.culprits:
            mine = lines.get(rank, [])
            first = next((i for i, ln in enumerate(mine) if "error" in ln.lower() or ln.startswith("Traceback")), None)
            if first is None:  # its lines are not in the log (or there is no log): what its status file says
                error = verdict.own[rank]
                excerpt.append(f"[rank {rank}] {error['kind']}: {error['message'][:400]}")
            else:
                excerpt += [f"[rank {rank}] {ln[:400]}" for ln in mine[first : first + excerpt_lines]]
            if len(excerpt) >= excerpt_lines:
                break
    elif any_status:
        # Ranks that died silently: the last line each printed, what their peers saw, and what mpirun saw.
        excerpt += [
            f"[rank {r}] last line: {lines[r][-1][:300]}"
            for r in verdict.culprits[: excerpt_lines // 2]
            if lines.get(r)
        ]
        excerpt += [f"[rank {r}] {verdict.witnesses[r]['message'][:600]}" for r in sorted(verdict.witnesses)[:2]]
        excerpt += [m.group(0) for m in _DOWNSTREAM.finditer(text)][:2]
        excerpt += [m.group(0) for m in _SRUN_ENDED.finditer(text)][:1]
    else:
        excerpt = [ln[:400] for ln in text.splitlines()[-excerpt_lines:]]
    return excerpt


def stop_summary(stop: dict, recorded: int | None = None, world: int | None = None) -> str:
    """'stopped by SIGTERM at step 12 (checkpoint-12 written); resume with -e resume=latest' for a Stop (a status
    file's ``stop``), with how many ranks recorded it when not all did."""
    what = "the time limit" if stop["reason"] == "time_limit" else stop["signal"]
    if stop["step"]:
        where = f"at step {stop['step']}" + (f" ({stop['checkpoint']} written)" if stop.get("checkpoint") else "")
        todo = "resume with -e resume=latest"
    else:
        where = "before the first training step"
        todo = "nothing of this attempt was saved: start it again (-e resume=latest continues an earlier checkpoint)"
    counted = f" ({recorded}/{world} ranks recorded it)" if world and recorded is not None and recorded < world else ""
    return f"stopped by {what} {where}{counted}; {todo}"


def _stopped(current: dict[int, dict], world: int) -> dict | None:
    """The stop the ranks recorded (rank 0's, else the lowest rank's), or None when no rank of the attempt did."""
    interrupted = {r: s for r, s in sorted(current.items()) if s["state"] == "interrupted" and s.get("stop")}
    if not interrupted:
        return None
    stop = interrupted.get(0, next(iter(interrupted.values())))["stop"]
    summary = stop_summary(stop, len(interrupted), world)
    steps = sorted({s["stop"]["step"] for s in interrupted.values()})
    if len(steps) > 1:
        summary += f" (the ranks stopped at different steps: {', '.join(map(str, steps))})"
    return {"nodes": [], "ranks": [], "summary": summary, "excerpt": [], "stopped": stop}


def diagnose(
    statuses: list,
    nodes: list[dict],
    ranks_per_node: int,
    attempt: int | None = None,
    log_text: str = "",
    excerpt_lines: int = 12,
) -> dict:
    """Which node(s) and rank(s) ended a failed job, from the ranks' status files, with their first log lines.

    ``statuses``: every rank status file found on the nodes (those of an earlier ``attempt`` are ignored). A rank
    with an error of its own (bad input, an exception) is the cause. Without one, ranks that recorded a stop (state
    interrupted) make it a job that stopped as it was told to: the answer's ``stopped`` is their Stop and its
    summary says by what, at which step, and to resume. Otherwise the ranks that failed on a lost
    peer or a collective timeout are witnesses, and the cause is the ranks that fell silent (no error, not done)
    on the nodes the witnesses name as the peer that went away (when none could report before mpirun ended them,
    on the node Hydra reports it lost), or else simply the silent ones. ``log_text`` (this attempt's part of
    train.log) otherwise only gives the excerpt: the failing ranks' own lines.
    """
    current, problems = _current(statuses, attempt)
    world = max((s["world"] for s in current.values()), default=0) or ranks_per_node * len(nodes)
    by_addr = {n["address"]: n["name"] for n in nodes}

    def node_of(rank: int) -> str:
        if rank in current:
            return by_addr.get(current[rank]["address"], current[rank]["node"])
        index = rank // max(1, ranks_per_node)
        return nodes[index]["name"] if index < len(nodes) else "?"

    verdict = _verdict(current, world, by_addr, node_of, log_text)
    stopped = None if verdict.own else _stopped(current, world)
    if stopped is not None:  # told to stop, and it did: not a failure of any rank
        return stopped
    excerpt = _excerpt(verdict, bool(current), log_text, excerpt_lines)
    order = [n["name"] for n in nodes]
    bad_nodes = sorted(
        {node_of(r) for r in verdict.culprits}, key=lambda n: order.index(n) if n in order else len(order)
    )
    parts = []
    for node in bad_nodes:
        mine = [r for r in verdict.culprits if node_of(r) == node]
        parts.append(f"{node} (rank{'s' if len(mine) > 1 else ''} {compress_ranks(mine)})")
    summary = f"{', '.join(parts) or 'unknown node'}: {verdict.kind}"
    if not verdict.own and verdict.witnesses:
        summary += f"; {len(verdict.witnesses)} other rank(s) reported losing them"
    if problems:
        summary += f"; {len(problems)} status file(s) could not be read"
    return {
        "nodes": bad_nodes,
        "ranks": verdict.culprits,
        "summary": summary,
        "excerpt": excerpt[: excerpt_lines + 1] + problems[:2],
    }


# ---- the poll: what xeonsd_job returns ---------------------------------------------------------------------------


def async_state(results_file: str | Path) -> dict:
    """Ansible's async results: {"finished": bool, ...} (the same rules as async_status)."""
    try:
        with open(results_file) as fh:
            data = json.load(fh)
    except (FileNotFoundError, ValueError):  # not there yet, or being written
        return {"finished": False}
    data["finished"] = "started" not in data or bool(data.get("finished"))
    return data


def _failure(params: dict, rc: int, exit_info: dict, log_text: str) -> dict:
    if rc == LOCK_CONFLICT_RC:
        return {
            "nodes": [],
            "ranks": [],
            "excerpt": [],
            "summary": "another finetune holds the lock on the primary; it was not started twice",
        }
    statuses = params.get("rank_status")
    if statuses is None:
        statuses = read_status_dir(os.path.join(params["run_dir"], STATUS_DIR))
    failure = diagnose(
        statuses, params["nodes"], params["ranks_per_node"], exit_info.get("attempt"), log_text, params["excerpt_lines"]
    )
    if (rc == ASYNC_TIMEOUT_RC or exit_info.get("timed_out")) and not failure.get("stopped"):
        failure["summary"] = f"the job ran past its time limit; {failure['summary']}"
    slurm = read_slurm_job(params["run_dir"])
    stopped = failure.get("stopped")
    if slurm is not None and stopped is not None and stopped["reason"] == "time_limit":
        # The ranks stopped on the batch job's warning signal: their stop already says the time limit, the step
        # and its checkpoint; the job id is what Slurm adds.
        failure["summary"] += f" (Slurm job {slurm.job_id})"
    elif slurm is not None and slurm.stopped_by_time_limit:
        step = read_progress(params["run_dir"], params["total_steps"])["step"]
        failure["summary"] = (
            f"stopped by the time limit at step {step} (Slurm job {slurm.job_id}, {slurm.state}); resume with "
            f"-e resume=latest; {failure['summary']}"
        )
    return failure


def job_state(params: dict) -> dict:
    """The poll's answer. ``params``: run_dir, results_file, nodes ([{name, address}] in nodefile order),
    ranks_per_node, total_steps, excerpt_lines, wait_s (wait up to this long for the job's end first), and
    rank_status: the status files gathered from every node (None: this node's own ``status/`` directory, all of
    them on a one-node cluster). Raises StatusFileError for an exit.json or attempt.json of another schema."""
    run_dir = params["run_dir"]
    launch = async_state(params["results_file"])
    # wait_s: a long poll. The answer comes as soon as the job ends, or after wait_s with its progress, so the play
    # sees the end at once instead of up to a poll interval later.
    deadline = time.monotonic() + float(params.get("wait_s") or 0)
    while not launch["finished"] and time.monotonic() < deadline:
        time.sleep(0.2)
        launch = async_state(params["results_file"])
    progress = read_progress(run_dir, params["total_steps"])
    log_text = attempt_log(run_dir)
    world = params["ranks_per_node"] * len(params["nodes"]) if params["nodes"] else None
    result = {
        "changed": False,
        "finished": launch["finished"],
        # Not "rc": Ansible marks any result whose rc is non-zero as a failed task, and the poll itself did not fail.
        "exit_code": None,
        "progress": progress,
        "msg": progress_line(progress, ranks_up(log_text), world),
        # One line per straggler node; the xeonsd_progress callback prints each node's once.
        "straggler_warnings": {s["node"]: straggler_warning(s) for s in progress.get("stragglers", [])},
        # Every node low on CPU (the layout or the shared load, not a node): one line, printed once.
        "layout_warning": (progress.get("layout_verdict") or {}).get("text"),
    }
    if launch["finished"]:
        ended = read_exit(run_dir)
        exit_info = dataclasses.asdict(ended) if ended else {}
        result["exit"] = exit_info
        rc = exit_info.get("rc", launch.get("rc"))
        if rc is None:
            rc = ASYNC_TIMEOUT_RC if _ASYNC_TIMEOUT.search(str(launch.get("msg", ""))) else 1
        result["exit_code"] = rc
        if rc != 0:
            result["failure"] = _failure(params, rc, exit_info, log_text)
        result["msg"] = f"finished (rc {rc}) · " + result["msg"]
    result["checked_at"] = time.time()
    return result
