"""doctor_rows: doctor.yml's table rows from the raw results of its tasks (roles/doctor); doctor_table: the table
as text, its verdict and what to do about each FAIL (the report task only prints it).

Every row is {"node", "check", "status", "detail"}: the nodes in inventory order (xeonsd doctor's own checks, the
node compared with the others, then SSH from the primary), then the cluster (nodefile, mpirun hello).

The comparison: a node whose trial step takes more than ``ratio`` × the median node's holds every rank back at
each all-reduce of the real job (a straggler); a cluster that mixes CPU generations is its usual cause. The exit codes below are those of the
mpi role's wrapper (/etc/xeonsd/run, roles/mpi/templates/run.j2) that roles/doctor/tasks/{node,cluster}.yml run
under `timeout`, of `timeout`, and of `xeonsd doctor`.
"""

from __future__ import annotations

import base64
import json
import re
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

# xeonsd's standard-library-only parts, from the controller's venv (`make install`: see plugins/README.md).
from xeonsd.contracts import straggler_rule

# The straggler rule (its ratio and likely causes) is the trainer's, from the contracts imported above.
STRAGGLER_RATIO: float = straggler_rule.STRAGGLER_RATIO
STRAGGLER_CAUSES: tuple[str, ...] = straggler_rule.CAUSES

# The wrapper /etc/xeonsd/run: no readable env.sh (90), the command (xeonsd, mpirun) not on the PATH env.sh sets (91).
# Defined here once: the mpi role's template (roles/mpi/templates/run.j2) exits with `'no_env_file' | xeonsd_wrapper_rc`.
RC_NO_ENV_FILE = 90
RC_NO_COMMAND = 91
WRAPPER_RCS = {"no_env_file": RC_NO_ENV_FILE, "no_command": RC_NO_COMMAND}


def wrapper_rc(name: str) -> int:
    """The exit code of the job-environment wrapper for ``name`` (``no_env_file`` or ``no_command``)."""
    if name not in WRAPPER_RCS:
        raise ValueError(f"xeonsd_wrapper_rc: {name!r} is not one of {sorted(WRAPPER_RCS)}")
    return WRAPPER_RCS[name]


# `timeout --kill-after`: 124 when the limit ended the command, 137 when it had to be killed; 126/127 when it could
# not start the wrapper (not executable, missing: the node is not provisioned).
RC_TIMED_OUT = (124, 137)
RC_NO_WRAPPER = (126, 127)
RC_NO_ENV = (RC_NO_ENV_FILE, RC_NO_COMMAND, *RC_NO_WRAPPER)
# `xeonsd doctor`: 0 every check passed, 1 a check failed, 2 the model cannot be found; each with its JSON report.
RC_DOCTOR_REPORTED = (0, 1, 2)

_HELLO_ERROR = re.compile(r"^.*xeonsd hello: error: ")
_RANK_PREFIX = re.compile(r"^rank [0-9]+: ")


def _row(node: str, check: str, status: str, detail: str) -> dict[str, str]:
    return {"node": node, "check": check, "status": status, "detail": detail}


def _last_nonempty(lines: Sequence[str] | None) -> str:
    lines = [line for line in (lines or []) if line]
    return lines[-1] if lines else ""


def node_rows(host: str, result: Mapping[str, Any] | None, check_limit_s: int) -> list[dict[str, str]]:
    """The rows of one node's `xeonsd doctor` run (the registered result of node.yml's command)."""
    r = result or {}
    if r.get("unreachable"):
        return [_row(host, "reach", "FAIL", "unreachable from the controller: " + str(r.get("msg", "")).strip())]
    if "rc" not in r:
        return [_row(host, "doctor", "FAIL", "no result: " + str(r.get("msg", "the node left the play; see above")))]
    rc = r["rc"]
    if rc in RC_NO_ENV:
        return [_row(host, "env", "FAIL", str(r.get("stderr", "")).strip())]
    report = _report(r)
    rows = [_row(host, c["name"], c["status"], c["detail"]) for c in report.get("checks", [])]
    if rc in RC_TIMED_OUT:
        rows.append(_row(host, "doctor", "FAIL", f"xeonsd doctor did not finish within {check_limit_s} s"))
    elif not report or rc not in RC_DOCTOR_REPORTED:
        last_error = _last_nonempty(r.get("stderr_lines")) or "no output"
        rows.append(_row(host, "doctor", "FAIL", f"xeonsd doctor exited with rc {rc}: {last_error}"))
    return rows


def _report(result: Mapping[str, Any] | None) -> dict:
    """The JSON report a node's `xeonsd doctor --json` printed, or {}."""
    found = [line for line in (result or {}).get("stdout_lines", []) if line.startswith("{")]
    return json.loads(found[-1]) if found else {}


def _trial_s(report: Mapping[str, Any]) -> float | None:
    for check in report.get("checks") or []:
        if check.get("name") == "train 1 step" and check.get("status") == "PASS" and check.get("seconds"):
            return float(check["seconds"])
    return None


def _cpu(facts: Mapping[str, Any]) -> str:
    amx = "AMX" if facts.get("amx") else "no AMX"
    return f"{facts.get('cpu_model', '?')} · {facts.get('cores', '?')} cores · {amx}"


def compare_rows(
    reports: Mapping[str, Mapping[str, Any]], ratio: float | None = None
) -> dict[str, list[dict[str, str]]]:
    """``{host: doctor JSON}`` → ``{host: [row, …]}``: a ``cpu`` row (WARN when the nodes' CPUs differ) and a
    ``straggler`` row (WARN when its trial step is over ``ratio`` × the median of the nodes'; None: the straggler
    rule's)."""
    ratio = STRAGGLER_RATIO if ratio is None else ratio
    facts = {h: r["node"] for h, r in reports.items() if r and r.get("node")}
    kinds = Counter(_cpu(f) for f in facts.values())
    mixed = ", ".join(f"{n}× {k}" for k, n in kinds.most_common()) if len(kinds) > 1 else ""
    times = {h: t for h, r in reports.items() if r and (t := _trial_s(r)) is not None}
    median = statistics.median(times.values()) if len(times) > 1 else None
    out: dict[str, list[dict[str, str]]] = {}
    for host in reports:
        rows = out.setdefault(host, [])
        if host in facts:
            detail = _cpu(facts[host]) + (f"; the cluster mixes {mixed}" if mixed else "")
            rows.append(_row(host, "cpu", "WARN" if mixed else "PASS", detail))
        if median and host in times:
            slow = times[host] > ratio * median
            detail = f"trial step {times[host]:.2f} s = {times[host] / median:.2f}× the median {median:.2f} s"
            if slow:
                detail += f" (over {ratio}×): a straggler; likely causes, in order: {'; '.join(STRAGGLER_CAUSES)}"
            rows.append(_row(host, "straggler", "WARN" if slow else "PASS", detail))
    return out


def ssh_row(host: str, result: Mapping[str, Any] | None, route: str) -> dict[str, str]:
    """SSH from the primary to the node's MPI address (one item of cluster.yml's loop)."""
    s = result or {}
    if s.get("rc") == 0:
        return _row(host, "ssh from primary", "PASS", route)
    why = _last_nonempty(s.get("stderr_lines")) or str(s.get("msg", "no result (the primary is unreachable?)"))
    return _row(host, "ssh from primary", "FAIL", f"{route}: {why.strip()}")


def nodefile_row(
    nodefile: Mapping[str, Any],
    listed: Sequence[str] | None,
    expected: Sequence[str],
    where: str,
    mpi_ranks: int,
    ranks_per_node: int,
    ranks_mismatch: str,
) -> dict[str, str]:
    """The nodefile on the primary against the inventory's addresses (primary first), and mpi_ranks that fit
    (ranks_mismatch: the xeonsd_ranks_mismatch filter's verdict, plugins/filter/xeonsd_cluster.py)."""
    if listed is None:
        return _row("cluster", "nodefile", "FAIL", f"cannot read {where}: {nodefile.get('msg', 'no result')}")
    listed, expected = list(listed), list(expected)
    if listed != expected:
        return _row(
            "cluster",
            "nodefile",
            "FAIL",
            f"{where} lists {' '.join(listed) or 'nothing'}; the inventory has {' '.join(expected)} (primary first)",
        )
    if ranks_mismatch:
        return _row("cluster", "nodefile", "FAIL", ranks_mismatch)
    shape = f"{mpi_ranks} ranks = {len(expected)} nodes x {ranks_per_node}"
    return _row("cluster", "nodefile", "PASS", f"{where}: {len(listed)} nodes, primary first; {shape}")


def hello_row(
    h: Mapping[str, Any], primary: str, mpi_ranks: int, ranks_per_node: int, hello_limit_s: int
) -> dict[str, str]:
    """mpirun hello across every rank: its summary line, or the cause to act on."""
    if h.get("unreachable") or "rc" not in h:
        return _row(
            "cluster", "mpirun hello", "FAIL", f"not run on {primary}: {str(h.get('msg', 'no result')).strip()}"
        )
    rc = h["rc"]
    if rc == 0:
        hello = [line for line in h.get("stdout_lines", []) if line.startswith("hello: ")]
        return _row("cluster", "mpirun hello", "PASS", hello[-1] if hello else "")
    errors = list(
        dict.fromkeys(_HELLO_ERROR.sub("", line) for line in h.get("stderr_lines", []) if _HELLO_ERROR.match(line))
    )
    if rc in RC_TIMED_OUT:
        why = f"mpirun did not finish within {hello_limit_s} s"
    elif rc in RC_NO_ENV:
        why = str(h.get("stderr", "")).strip()
    elif errors:
        # A cause that every rank shares (not "rank N: ...") first: it is the one to act on.
        shared = [e for e in errors if not _RANK_PREFIX.match(e)]
        ranked = [e for e in errors if _RANK_PREFIX.match(e)]
        why = "; ".join((shared + ranked)[:2])
    else:
        why = _last_nonempty(h.get("stderr_lines")) or "no output"
    return _row("cluster", "mpirun hello", "FAIL", f"mpirun -n {mpi_ranks} -ppn {ranks_per_node} (rc {rc}): {why}")


def home_row(home: Mapping[str, Any] | None, primary: str) -> dict[str, str]:
    """Whether the nodes share the account's home (roles/doctor/tasks/home.yml: the primary's probe file, looked
    for from every other node), against the inventory's shared_home (auto, true or false)."""
    if not home or not home.get("probed"):
        why = (home or {}).get("why") or "the primary could not write its probe file"
        return _row("cluster", "home", "WARN", f"not probed: {why}")
    where, seen, others = f"{primary}'s {home['dir']}", list(home["seen"]), list(home["others"])
    setting = str(home.get("setting", "auto")).lower()
    shared = bool(others) and seen == others
    if seen and not shared:
        apart = ", ".join(h for h in others if h not in seen)
        return _row(
            "cluster", "home", "FAIL", f"shared by some nodes only: {', '.join(seen)} see {where}, {apart} do not"
        )
    if setting != "auto" and (setting in ("true", "yes", "1")) != shared:
        found = "shared" if shared else "each node's own"
        return _row("cluster", "home", "FAIL", f"shared_home is {setting} but the home is {found} ({where})")
    if shared:
        detail = (
            f"shared: every node sees {where} (written once, by {primary}: the images, the model, ~/.ssh; the env "
            "and the caches on each node's own disk)"
        )
        return _row("cluster", "home", "PASS", detail)
    return _row("cluster", "home", "PASS", f"each node has its own {home['dir']}" if others else "one node")


def doctor_rows(
    hosts: Sequence[str],
    results: Sequence[Mapping[str, Any] | None],
    addresses: Sequence[str],
    ssh: Sequence[Mapping[str, Any]],
    nodefile: Mapping[str, Any],
    hello: Mapping[str, Any],
    *,
    primary: str,
    user: str,
    expected: Sequence[str],
    nodefile_path: str,
    mpi_ranks: int | str,
    ranks_per_node: int | str,
    ranks_mismatch: str,
    check_limit_s: int | str,
    hello_limit_s: int | str,
    straggler_ratio: float | str | None = None,
    home: Mapping[str, Any] | None = None,
) -> list[dict[str, str]]:
    """Every row of the table.

    hosts, results, addresses: the nodes in the play, in inventory order, with their registered doctor_node
    ({} where the node left the play) and MPI address; ssh: the results of cluster.yml's SSH loop (each with
    "item": the host); nodefile: the slurp of the nodefile; hello: the mpirun hello; expected: the inventory's
    MPI addresses in nodefile order (cluster_nodes); ranks_mismatch: the xeonsd_ranks_mismatch filter's verdict on
    mpi_ranks and ranks_per_node (empty when they fit); home: the shared-home probe (home_row).
    """
    mpi_ranks, ranks_per_node = int(mpi_ranks), int(ranks_per_node)
    by_host = {res.get("item"): res for res in ssh}
    ratio = None if straggler_ratio is None or str(straggler_ratio).strip() == "" else float(straggler_ratio)
    compared = compare_rows({h: _report(r) for h, r in zip(hosts, results, strict=True)}, ratio)
    rows: list[dict[str, str]] = []
    for host, result, address in zip(hosts, results, addresses, strict=True):
        rows += node_rows(host, result, int(check_limit_s))
        rows += compared.get(host, [])
        rows.append(ssh_row(host, by_host.get(host), f"{user}@{primary} -> {address}"))
    listed = base64.b64decode(nodefile["content"]).decode().split() if "content" in nodefile else None
    where = f"{nodefile_path} on {primary}"
    rows.append(nodefile_row(nodefile, listed, expected, where, mpi_ranks, ranks_per_node, ranks_mismatch))
    rows.append(hello_row(hello, primary, mpi_ranks, ranks_per_node, int(hello_limit_s)))
    rows.append(home_row(home, primary))
    return rows


HEADS = _row("node", "check", "status", "detail")
DEFAULT_FIX = "read the detail above"


def _truncate(text: str, length: int, end: str = "...", leeway: int = 5) -> str:
    """Jinja's ``truncate`` (at a word, within ``leeway`` characters over ``length``)."""
    if len(text) <= length + leeway:
        return text
    return text[: length - len(end)].rsplit(" ", 1)[0] + end


def doctor_table(rows: Sequence[Mapping[str, str]], fixes: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The doctor's report from its rows (doctor_rows) and ``fixes`` (doctor_fixes: check name → what to do,
    ``{node}`` replaced by the node's name).

    Returns ``{"lines", "verdict", "failed", "message"}``: the table's lines (``node  check  status  detail``, the
    columns padded to their widest value, details truncated at 300 characters), then ``RESULT: PASS (…)`` or
    ``RESULT: FAIL (…). What to do:`` and one line per FAIL; ``verdict`` "PASS" or "FAIL"; ``failed`` the FAIL
    rows; ``message`` the play's failure message naming them ("" when none failed)."""
    rows, fixes = list(rows), fixes or {}
    width_node = max(len(r["node"]) for r in [HEADS, *rows])
    width_check = max(len(r["check"]) for r in [HEADS, *rows])
    failed = [r for r in rows if r["status"] == "FAIL"]
    warned = [r for r in rows if r["status"] == "WARN"]
    lines = [
        f"{r['node'].ljust(width_node)}  {r['check'].ljust(width_check)}  {r['status'].ljust(6)}  "
        f"{_truncate(r['detail'], 300)}"
        for r in [HEADS, *rows]
    ]
    if not failed:
        lines.append(
            f"RESULT: PASS ({len(rows)} checks, {len(warned)} warnings): the cluster is ready for "
            "ansible-playbook finetune.yml"
        )
        return {"lines": lines, "verdict": "PASS", "failed": [], "message": ""}
    lines.append(f"RESULT: FAIL ({len(failed)} of {len(rows)} checks failed, {len(warned)} warnings). What to do:")
    lines += [
        f"  {r['node']} {r['check']}: {fixes.get(r['check'], DEFAULT_FIX).replace('{node}', r['node'])}" for r in failed
    ]
    nodes = ", ".join(dict.fromkeys(r["node"] for r in failed))
    causes = "; ".join(f"{r['node']} {r['check']} ({_truncate(r['detail'], 200)})" for r in failed)
    message = f"doctor: {len(failed)} check(s) failed on {nodes}: {causes}. See the table above for what to do."
    return {"lines": lines, "verdict": "FAIL", "failed": failed, "message": message}


class FilterModule:
    def filters(self) -> dict:
        return {
            "xeonsd_doctor_rows": doctor_rows,
            "xeonsd_doctor_table": doctor_table,
            "xeonsd_wrapper_rc": wrapper_rc,
        }
