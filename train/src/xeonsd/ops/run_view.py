"""The cluster over a whole run, for report.html and run.json: per-node CPU use, time split, stragglers, cost.

Everything comes from the metrics rows that carry ``rank_stats`` (see :mod:`xeonsd.cluster.rank_stats`) and, for the cost,
from run.json's ``cost`` (the inventory's ``node_hour_price`` with its currency, optionally ``gpu_hour_price`` and
``gpu_s_per_step`` for the same job on a GPU).
"""

from __future__ import annotations

import base64
import io
import statistics
from typing import Any

SPLIT = ("compute_s", "allreduce_s", "data_s")


def stats_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("rank_stats")]


def utilisation(rows: list[dict]) -> dict[str, dict[str, Any]]:
    """Per node: its CPU utilisation at each gathered step, and the run's mean, lowest and ranks."""
    out: dict[str, dict[str, Any]] = {}
    for r in stats_rows(rows):
        for n in r["rank_stats"]["nodes"]:
            d = out.setdefault(n["node"], {"ranks": n["ranks"], "steps": [], "cpu_util": []})
            d["steps"].append(r["step"])
            d["cpu_util"].append(n["cpu_util"])
    for d in out.values():
        d["mean"] = round(statistics.fmean(d["cpu_util"]), 4)
        d["lowest"] = min(d["cpu_util"])
    return out


def time_split(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per node: the mean seconds per step in compute, waiting in the all-reduce, and data, over the run."""
    sums: dict[str, list[dict]] = {}
    for r in stats_rows(rows):
        for n in r["rank_stats"]["nodes"]:
            sums.setdefault(n["node"], []).append(n)
    return {node: {k: round(statistics.fmean(x[k] for x in ns), 4) for k in SPLIT} for node, ns in sums.items()}


def stragglers(rows: list[dict]) -> list[dict]:
    """Each node the trainer flagged, with the step it was first flagged at and its newest reasons."""
    found: dict[str, dict] = {}
    for r in rows:
        for s in r.get("stragglers") or []:
            first = found.get(s["node"], {}).get("first_step", r["step"])
            found[s["node"]] = {**s, "first_step": first, "last_step": r["step"]}
    return list(found.values())


def layout_verdict(rows: list[dict]) -> dict | None:
    """The trainer's newest verdict that every node was low on CPU (the layout or the shared load), with the step
    it was first made at; None when it never was."""
    found = [r for r in rows if r.get("layout_verdict")]
    if not found:
        return None
    return {**found[-1]["layout_verdict"], "first_step": found[0]["step"], "last_step": found[-1]["step"]}


def _num(value: Any) -> float | None:
    if value in (None, ""):
        return None
    return float(value)


def cost(rows: list[dict], prices: dict, nodes: int, train_wall_s: float | None, image_s: float | None) -> dict:
    """The run's cost from ``prices`` (run.json's ``cost``); empty when no node_hour_price is set.

    node-hours = nodes × the training job's wall time (else the sum of the step times); per 100 steps and the GPU
    comparison use the median s/step; per generated image: one node for 1 / images_per_s of ``xeonsd generate``.
    """
    price = _num(prices.get("node_hour_price"))
    if price is None or not rows or nodes < 1:
        return {}
    currency = prices.get("currency") or ""
    s_per_step = statistics.median(r["s_per_step"] for r in (rows[1:] or rows))
    wall = train_wall_s if train_wall_s else sum(r["s_per_step"] for r in rows)
    node_hours = nodes * wall / 3600
    out: dict[str, Any] = {
        "currency": currency,
        "node_hour_price": price,
        "nodes": nodes,
        "node_hours": round(node_hours, 4),
        "training_cost": round(node_hours * price, 4),
        "cost_per_100_steps": round(nodes * price * s_per_step * 100 / 3600, 4),
        "s_per_step": round(s_per_step, 4),
    }
    if image_s:
        out["cost_per_generated_image"] = round(price * image_s / 3600, 6)
    gpu_price, gpu_s = _num(prices.get("gpu_hour_price")), _num(prices.get("gpu_s_per_step"))
    if gpu_price is not None and gpu_s:
        cpu_hour = nodes * price
        gpu_100 = gpu_price * gpu_s * 100 / 3600
        out["gpu"] = {
            "gpu_hour_price": gpu_price,
            "gpu_s_per_step": gpu_s,
            "cluster_hour_price": cpu_hour,
            "gpu_cost_per_100_steps": round(gpu_100, 4),
            "price_ratio_gpu_to_cluster": round(gpu_price / cpu_hour, 3),
            "cost_ratio_gpu_to_cluster": round(gpu_100 / out["cost_per_100_steps"], 3),
        }
    return out


def figures(rows: list[dict], prices: dict, train_wall_s: float | None, image_s: float | None) -> dict:
    """What run.json's ``cluster_figures`` holds (the report's tables and plots show the same)."""
    util = utilisation(rows)
    nodes = len(util) or 1
    return {
        "cpu_util": {n: {"mean": d["mean"], "lowest": d["lowest"], "ranks": d["ranks"]} for n, d in util.items()},
        "time_split_s_per_step": time_split(rows),
        "stragglers": stragglers(rows),
        "layout_verdict": layout_verdict(rows),
        "cost": cost(rows, prices, nodes, train_wall_s, image_s),
    }


def _pyplot() -> Any:
    """matplotlib.pyplot, drawing without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png")
    finally:
        _pyplot().close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def utilisation_png(rows: list[dict]) -> str:
    """Per-node CPU utilisation over the run, with the warning threshold; a data: URL."""
    util = utilisation(rows)
    fig, ax = _pyplot().subplots(figsize=(7, 3.5), dpi=100)
    for node, d in util.items():
        ax.plot(d["steps"], [100 * u for u in d["cpu_util"]], marker="o", ms=3, label=node)
    thresholds = stats_rows(rows)[-1]["rank_stats"].get("thresholds", {})
    if "cpu_util" in thresholds:
        ax.axhline(100 * thresholds["cpu_util"], color="tab:red", ls="--", lw=1, label="warning threshold")
    ax.set_xlabel("step")
    ax.set_ylabel("CPU utilisation (%)")
    ax.set_ylim(bottom=0)
    ax.set_title("CPU time ÷ (wall time × threads), mean of each node's ranks")
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    return _png(fig)


def split_png(rows: list[dict]) -> str:
    """Per node, the mean step split into compute, all-reduce wait and data, as stacked bars; a data: URL."""
    split = time_split(rows)
    names = list(split)
    fig, ax = _pyplot().subplots(figsize=(7, 0.6 * len(names) + 1.4), dpi=100)
    left = [0.0] * len(names)
    for key, label, color in zip(
        SPLIT, ("compute", "waiting in the all-reduce", "data"), ("tab:blue", "tab:orange", "tab:green"), strict=True
    ):
        widths = [split[n][key] for n in names]
        ax.barh(names, widths, left=left, label=label, color=color)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step (mean over the run)")
    ax.legend(fontsize="small", ncol=3, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)  # over the bars
    fig.tight_layout()
    return _png(fig)
