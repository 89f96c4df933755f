"""doctor.yml's comparison of the nodes: the one-step trial times against the median, and the CPUs side by side.

A node whose trial step takes more than ``ratio`` × the median node's holds every rank back at each all-reduce of
the real job (a straggler); a cluster that mixes CPU generations is its usual cause. Pure functions over the JSON
that ``xeonsd doctor --json`` prints on each node; the tests import this file directly.
"""

from __future__ import annotations

import statistics
from collections import Counter

CAUSES = ("threads per rank vs. physical cores", "another process on the node", "memory pressure or swap",
          "a slower CPU")  # fmt: skip


def _trial_s(report: dict) -> float | None:
    for check in report.get("checks") or []:
        if check.get("name") == "train 1 step" and check.get("status") == "PASS" and check.get("seconds"):
            return float(check["seconds"])
    return None


def _cpu(facts: dict) -> str:
    return (
        f"{facts.get('cpu_model', '?')} · {facts.get('cores', '?')} cores · {'AMX' if facts.get('amx') else 'no AMX'}"
    )


def node_rows(reports: dict, ratio: float = 1.3) -> dict:
    """``{host: doctor JSON}`` → ``{host: [row, …]}``: a ``cpu`` row (WARN when the nodes' CPUs differ) and a
    ``straggler`` row (WARN when its trial step is over ``ratio`` × the median of the nodes')."""
    facts = {h: r["node"] for h, r in reports.items() if r and r.get("node")}
    kinds = Counter(_cpu(f) for f in facts.values())
    mixed = ", ".join(f"{n}× {k}" for k, n in kinds.most_common()) if len(kinds) > 1 else ""
    times = {h: t for h, r in reports.items() if r and (t := _trial_s(r)) is not None}
    median = statistics.median(times.values()) if len(times) > 1 else None
    out: dict = {}
    for host in reports:
        rows = out.setdefault(host, [])
        if host in facts:
            detail = _cpu(facts[host]) + (f"; the cluster mixes {mixed}" if mixed else "")
            rows.append({"node": host, "check": "cpu", "status": "WARN" if mixed else "PASS", "detail": detail})
        if median and host in times:
            slow = times[host] > ratio * median
            detail = f"trial step {times[host]:.2f} s = {times[host] / median:.2f}× the median {median:.2f} s"
            if slow:
                detail += f" (over {ratio}×): a straggler; likely causes, in order: {'; '.join(CAUSES)}"
            rows.append({"node": host, "check": "straggler", "status": "WARN" if slow else "PASS", "detail": detail})
    return out


class FilterModule:
    def filters(self) -> dict:
        return {"xeonsd_doctor_node_rows": node_rows}
