"""The commands run.sh and the roles run on a node, each answering on stdout (standard library only: cheap to import):

* ``xeonsd jobstatus begin|exit|poll|stop|ranks|codes``: run.sh's begin and exit (:mod:`.attempts`), the finetune
  role's poll (:mod:`.watch`), stop, ranks and codes, on the files of :mod:`xeonsd.contracts.job_status`;
* ``xeonsd runjson RUN_DIR``: the run_report role's run.json (:mod:`xeonsd.contracts.run_files`);
* ``xeonsd slurmjob record RUN_DIR --job-id ID``: run.sh's slurm.json under Slurm (:mod:`.slurm`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from xeonsd.contracts.job_status import EXIT_CODES, STATUS_DIR, StatusFileError, write_json
from xeonsd.contracts.run_files import RUN_JSON_FILE, RUN_JSON_INPUT, run_json
from xeonsd.jobs.attempts import begin_attempt, stop_job, write_exit
from xeonsd.jobs.slurm import record, summary

DESCRIPTION = (
    "begin RUN_DIR: start the run's next attempt (attempt.json) and print its number; "
    "exit RUN_DIR --rc RC: record how it ended (exit.json); "
    "poll RUN_DIR: the job's progress, and who ended it once it failed (JSON, the finetune role's xeonsd_job); "
    "stop RUN_DIR: SIGTERM to the running job's run.sh, which stops it cleanly at a checkpoint (JSON); "
    "ranks RUN_DIR: this node's rank status files (JSON); codes: the exit codes the playbooks tell apart (JSON)."
)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """``xeonsd jobstatus``, ``runjson`` and ``slurmjob``."""
    _add_jobstatus(sub)
    _add_runjson(sub)
    _add_slurmjob(sub)


def _add_jobstatus(sub: argparse._SubParsersAction) -> None:
    """``xeonsd jobstatus begin|exit|poll|stop|ranks|codes …``"""
    p = sub.add_parser(
        "jobstatus",
        help="record a training job's attempts and exit code, and read its state (the finetune role)",
        description=DESCRIPTION,
    )
    what = p.add_subparsers(dest="action", required=True)
    begin = what.add_parser("begin", help="start the next attempt; prints its number")
    begin.add_argument("--time-limit-s", type=int, help="the job's time limit (I_MPI_JOB_TIMEOUT)")
    end = what.add_parser("exit", help="record the attempt's exit code")
    end.add_argument("--rc", type=int, required=True, help="mpirun's exit code")
    poll = what.add_parser("poll", help="the job's state as JSON (progress; once it failed, who ended it)")
    poll.add_argument("--results-file", required=True, help="Ansible's async results file of the launch")
    poll.add_argument("--total-steps", type=int, required=True)
    poll.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="NAME=ADDRESS",
        help="the cluster's nodes in nodefile order (primary first), one flag each",
    )
    poll.add_argument("--ranks-per-node", type=int, default=1)
    poll.add_argument(
        "--wait-s", type=float, default=0.0, help="wait up to this long for the job's end before answering"
    )
    poll.add_argument("--excerpt-lines", type=int, default=12)
    poll.add_argument(
        "--rank-status",
        choices=["-"],
        help="-: read the rank status files gathered from every node as a JSON list on stdin "
        "(default: this node's own)",
    )
    stop = what.add_parser("stop", help="stop the running job cleanly (SIGTERM to its run.sh), as JSON")
    ranks = what.add_parser("ranks", help="this node's rank status files of the run, as JSON")
    for action in (begin, end, poll, stop, ranks):
        action.add_argument("run_dir", type=Path)
    what.add_parser("codes", help="the exit codes the playbooks tell apart, as JSON")
    p.set_defaults(func=jobstatus_main)


def _poll_params(args: argparse.Namespace) -> dict:
    nodes = []
    for item in args.node:
        name, sep, address = item.partition("=")
        if not (sep and name and address):
            raise StatusFileError(f"--node {item!r}: expected NAME=ADDRESS")
        nodes.append({"name": name, "address": address})
    return {
        "run_dir": str(args.run_dir),
        "results_file": args.results_file,
        "nodes": nodes,
        "ranks_per_node": args.ranks_per_node,
        "total_steps": args.total_steps,
        "excerpt_lines": args.excerpt_lines,
        "wait_s": args.wait_s,
        "rank_status": json.load(sys.stdin) if args.rank_status == "-" else None,
    }


def _answer(args: argparse.Namespace) -> object:
    if args.action == "begin":
        return begin_attempt(args.run_dir, time_limit_s=args.time_limit_s).attempt
    if args.action == "exit":
        write_exit(args.run_dir, args.rc)
        return None
    if args.action == "stop":
        return stop_job(args.run_dir)
    from xeonsd.jobs import watch  # the reading (run.sh's begin and exit need none of it)

    if args.action == "poll":
        return watch.job_state(_poll_params(args))
    status_dir = Path(args.run_dir) / STATUS_DIR
    return {"status_dir": str(status_dir), "statuses": watch.read_status_dir(status_dir)}


def _run_dir(args: argparse.Namespace) -> Path:
    """The command's RUN_DIR; NotADirectoryError (one line from :func:`xeonsd.cli.main`, exit 2) when it is none."""
    if not args.run_dir.is_dir():
        raise NotADirectoryError(f"{args.run_dir} is not a directory")
    return args.run_dir


def jobstatus_main(args: argparse.Namespace) -> int:
    """``xeonsd jobstatus``; a bad run directory or status file is one line from :func:`xeonsd.cli.main`, exit 2."""
    if args.action == "codes":
        print(json.dumps(EXIT_CODES, sort_keys=True))
        return 0
    # A node where no rank started has no run directory: no status files, not an error.
    if args.action != "ranks":
        _run_dir(args)
    answer = _answer(args)
    if isinstance(answer, int):
        print(answer)
    elif answer is not None:
        print(json.dumps(answer, sort_keys=True))
    return 0


def write_run_json(run_dir: Path, facts: dict) -> bool:
    """Write run.json; whether it changed."""
    path = Path(run_dir) / RUN_JSON_FILE
    info = run_json(run_dir, facts)
    try:
        before = json.loads(path.read_text())
    except (OSError, ValueError):
        before = None
    if before == info:
        return False
    write_json(path, info)
    return True


def _add_runjson(sub: argparse._SubParsersAction) -> None:
    """``xeonsd runjson RUN_DIR`` (facts as JSON on stdin)."""
    p = sub.add_parser(
        "runjson",
        help="write a run's run.json from the play's facts (JSON on stdin; the run_report role)",
        description=f"Write RUN_DIR/run.json. Reads a JSON object on stdin with {', '.join(RUN_JSON_INPUT)}; "
        'prints {"changed": true|false}.',
    )
    p.add_argument("run_dir", type=Path)
    p.set_defaults(func=runjson_main)


def runjson_main(args: argparse.Namespace) -> int:
    run_dir = _run_dir(args)
    try:
        changed = write_run_json(run_dir, json.load(sys.stdin))
    except (ValueError, KeyError, TypeError) as exc:
        print(f"xeonsd runjson: error: {exc!r}", file=sys.stderr)
        return 2
    print(json.dumps({"changed": changed}))
    return 0


def _add_slurmjob(sub: argparse._SubParsersAction) -> None:
    """``xeonsd slurmjob record RUN_DIR --job-id ID``"""
    p = sub.add_parser(
        "slurmjob",
        help="record a Slurm batch job's accounting (sacct) in the run's slurm.json (the finetune role's run.sh)",
        description="record RUN_DIR --job-id ID: wait for the ended job's sacct line, write RUN_DIR/slurm.json "
        "and print its summary line.",
    )
    what = p.add_subparsers(dest="action", required=True)
    rec = what.add_parser("record", help="write slurm.json from sacct once the job ended")
    rec.add_argument("run_dir", type=Path)
    rec.add_argument("--job-id", required=True, help="the Slurm job id (sbatch --parsable)")
    rec.add_argument("--wait-s", type=float, default=60, help="how long to wait for the job's final sacct line")
    p.set_defaults(func=slurmjob_main)


def slurmjob_main(args: argparse.Namespace) -> int:
    """``xeonsd slurmjob record``; a bad run directory or job id, or no accounting, is one line (exit 2)."""
    run_dir = _run_dir(args)
    job_id = args.job_id.split(";")[0].strip()  # --parsable prints "ID" or "ID;CLUSTER"
    if not job_id.isdigit():
        raise ValueError(f"--job-id {args.job_id!r} is not a Slurm job id")
    print(summary(record(run_dir, job_id, wait_s=args.wait_s)))
    return 0
