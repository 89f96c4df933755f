"""xeonsd_sbatch_script: the batch script of a training job under Slurm (finetune_launcher: slurm).

The finetune role writes it to the run directory as ``job.sbatch``; its run.sh submits it from there with ``sbatch
--parsable --wait``, so the job holds the run lock while it runs, as mpirun does. One batch job on the inventory's
nodes (``--nodelist``, primary first: Slurm runs the batch script on the allocation's first node, where train.log
is), ``--ntasks-per-node`` ranks on each, ``--cpus-per-task`` cores each, the time limit and the warning signal
before it (``--signal=USR1@…``: the ranks checkpoint and stop), the partition and account when set. The ranks are
srun's tasks (``--mpi=none``: the trainer reads SLURM_PROCID and friends; its process group is torch's, not MPI's),
and a rank that exits with an error ends the whole step (``--kill-on-bad-exit``). Their lines are labelled the way
``mpirun -l`` labels them (``[rank] line``), so train.log reads the same under both launchers.

xeonsd_sinfo_problem: the preflight's verdict on a site's Slurm (finetune_launcher: slurm, slurm_install false)
from ``sinfo --noheader --node --format "%P %N"`` on the primary: what is wrong and its fix, or "" when the
partition exists and Slurm knows every node of the inventory.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence

from xeonsd.contracts.job_status import LOG_FILE  # every rank's lines go to train.log, as under mpirun

# A Slurm name (node, partition, account) the script may hold: no spaces, commas or shell characters.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
# srun --label's prefix ("  3: ") rewritten to mpirun -l's ("[3] ").
_RELABEL = r"s/^ *([0-9]+): /[\1] /"
REQUIRED = ("job_name", "nodes", "ranks_per_node", "cpus_per_task", "time_limit_s", "signal_s", "command")


def _positive(job: Mapping, key: str) -> int:
    try:
        value = int(job[key])
    except (TypeError, ValueError):
        raise ValueError(f"xeonsd_sbatch_script: {key} must be an integer, got {job[key]!r}") from None
    if value < 1:
        raise ValueError(f"xeonsd_sbatch_script: {key} must be at least 1, got {value}")
    return value


def _name(value: object, what: str) -> str:
    text = str(value)
    if not _NAME.match(text):
        raise ValueError(
            f"xeonsd_sbatch_script: {what} {text!r} is not a Slurm name (letters, digits, _ . - only). "
            "Fix: set it to the name Slurm uses (sinfo)."
        )
    return text


def hms(seconds: int) -> str:
    """Slurm's time format (--time=H:MM:SS) for a number of seconds."""
    h, rest = divmod(int(seconds), 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"


def sbatch_options(job: Mapping) -> list[str]:
    """The ``#SBATCH`` options of the job (see the module's docstring), checked: a wrong value raises ValueError
    naming it and the fix."""
    missing = [k for k in REQUIRED if k not in job]
    if missing:
        raise ValueError(f"xeonsd_sbatch_script: missing {', '.join(missing)}")
    nodes = job["nodes"]
    if isinstance(nodes, str) or not isinstance(nodes, Sequence) or not nodes:
        raise ValueError(f"xeonsd_sbatch_script: nodes must be a non-empty list of Slurm node names, got {nodes!r}")
    names = [_name(n, "node name") for n in nodes]
    limit, warn = _positive(job, "time_limit_s"), _positive(job, "signal_s")
    if warn >= limit:
        raise ValueError(
            f"xeonsd_sbatch_script: the warning signal {warn} s before the time limit does not fit in the time "
            f"limit of {limit} s. Fix: make finetune_slurm_signal_s smaller than finetune_timeout_s."
        )
    options = [
        f"--job-name={_name(job['job_name'], 'job name')}",
        f"--nodes={len(names)}",
        f"--nodelist={','.join(names)}",
        f"--ntasks-per-node={_positive(job, 'ranks_per_node')}",
        f"--cpus-per-task={_positive(job, 'cpus_per_task')}",
        f"--time={hms(limit)}",
        f"--signal=USR1@{warn}",
    ]
    for key in ("partition", "account"):
        if str(job.get(key) or ""):
            options.append(f"--{key}={_name(job[key], key)}")
    options += ["--output=slurm-%j.out", "--open-mode=append"]
    return options


def sbatch_script(job: Mapping) -> str:
    """The whole batch script: the options, the check that it runs on the primary, srun with the command."""
    options = sbatch_options(job)
    command = job["command"]
    if isinstance(command, str) or not isinstance(command, Sequence) or not command:
        raise ValueError(f"xeonsd_sbatch_script: command must be a non-empty argv list, got {command!r}")
    primary = str(job["nodes"][0])
    srun = ["srun", "--mpi=none", "--kill-on-bad-exit=1", "--label", "--chdir=/tmp", *map(str, command)]
    lines = [
        "#!/bin/bash",
        "# The training job under Slurm (roles/finetune; plugins/filter/xeonsd_slurm.py). run.sh submits it with",
        "# sbatch --parsable --wait from the run directory on the primary.",
        *(f"#SBATCH {o}" for o in options),
        "set -u",
        f'if [ "${{SLURMD_NODENAME:-}}" != {shlex.quote(primary)} ]; then',
        f'  echo "the batch script runs on ${{SLURMD_NODENAME:-?}}, not on the primary {primary}: train.log would'
        " not be where the play reads it. Fix: make the primary the first node in Slurm's order of the inventory's"
        ' nodes" >&2',
        "  exit 2",
        "fi",
        "# Every rank's lines labelled the way mpirun -l labels them ([rank] line).",
        f"{shlex.join(srun)} 2>&1 | sed -u -E {shlex.quote(_RELABEL)} >> {LOG_FILE}",
        'exit "${PIPESTATUS[0]}"',
    ]
    return "\n".join(lines) + "\n"


def parse_sinfo(lines: Sequence[str]) -> tuple[list[str], str, dict[str, list[str]]]:
    """``sinfo --noheader --node --format "%P %N"``'s lines (one a node and partition; the default partition
    marked ``*``): the partitions in Slurm's order, the default one ("" when none), the nodes of each partition."""
    partitions: list[str] = []
    default = ""
    nodes: dict[str, list[str]] = {}
    for line in lines:
        fields = line.split()
        if not fields:
            continue
        name = fields[0].rstrip("*")
        if fields[0].endswith("*") and not default:
            default = name
        if name not in nodes:
            partitions.append(name)
            nodes[name] = []
        nodes[name].append(fields[-1])
    return partitions, default, nodes


def sinfo_problem(sinfo: Mapping, partition: str, node_names: Sequence[str], primary: str) -> str:
    """What is wrong with the site's Slurm for the job, with the fix, or "" when nothing is.

    sinfo: the registered result of sinfo on ``primary`` (rc, stdout_lines, stderr); partition: the job's
    (slurm_partition; "" is Slurm's default); node_names: every inventory node's slurm_node_name."""
    if sinfo.get("rc") != 0:
        why = str(sinfo.get("stderr") or "").strip()
        return (
            f"sinfo failed on {primary}: {why}. Fix: check that slurmctld runs and that this node has its "
            "slurm.conf and munge key."
        )
    partitions, default, nodes = parse_sinfo(sinfo.get("stdout_lines") or [])
    chosen = str(partition or "") or default or "(none: set slurm_partition)"
    if chosen not in partitions:
        return (
            f"Slurm has no partition {chosen} (its partitions: {', '.join(partitions)}). Fix: set slurm_partition "
            "to one of them."
        )
    unknown = list(dict.fromkeys(str(n) for n in node_names if str(n) not in nodes[chosen]))
    if unknown:
        return (
            f"Slurm does not know {', '.join(unknown)} in partition {chosen}. Fix: set slurm_node_name of these "
            "hosts to their Slurm names (sinfo -N)."
        )
    return ""


class FilterModule:
    def filters(self) -> dict:
        return {"xeonsd_sbatch_script": sbatch_script, "xeonsd_sinfo_problem": sinfo_problem}
