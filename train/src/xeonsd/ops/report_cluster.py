"""The cluster sections of ``report.html``: CPU use per node, where the step time goes, stragglers, the memory per
node and cost.

Figures come from :mod:`xeonsd.ops.run_view` (the same ones run.json gets); this module only lays them out.
"""

from __future__ import annotations

import html

from xeonsd.ops import run_view as clusterview


def html_table(data: dict) -> str:
    """Two columns, key and value, both escaped."""
    cells = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in data.items())
    return f"<table>{cells}</table>"


def figure(src: str, alt: str, caption: str) -> str:
    """An image with its caption (``caption`` is HTML: the caller escapes what needs it)."""
    return f'<figure><img src="{src}" alt="{alt}"><figcaption>{caption}</figcaption></figure>'


def _pct(value: float) -> str:
    return f"{100 * value:.0f} %"


def _money(value: float, currency: str) -> str:
    return f"{value:.4g} {currency}".strip()


def cluster_sections(rows: list[dict], figs: dict, shared: dict[str, int] | None = None) -> list[str]:
    """CPU use per node (plot), the time split per node (stacked bars), the straggler verdict, the memory per node
    (``shared``: train_summary.json's ``startup.shared_weights_bytes``), the cost."""
    sections: list[str] = []
    if clusterview.stats_rows(rows):
        sections.append(_cpu_use_section(rows, figs))
        sections.append(_time_split_section(rows, figs))
        sections.append(_stragglers_section(rows, figs))
    memory = memory_section(rows, shared)
    if memory:
        sections.append(memory)
    if figs["cost"]:
        sections += _cost_sections(figs["cost"])
    return sections


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def memory_section(rows: list[dict], shared: dict[str, int] | None = None) -> str:
    """Each node's memory as the kernel shares it (xeonsd.cluster.memory): the sum of its ranks' PSS after loading
    and at its highest over the steps, beside the sum of their RSS, which counts each shared page once per rank; and
    the frozen weights the ranks of each node mapped from one shared file (``shared``: component -> bytes)."""
    loaded = {n["node"]: n for r in rows for n in r.get("memory_loaded", {}).get("nodes", [])}
    peak: dict[str, tuple[dict, int]] = {}
    for r in rows:
        for n in r.get("memory", {}).get("nodes", []):
            if n["node"] not in peak or n["pss_bytes"] > peak[n["node"]][0]["pss_bytes"]:
                peak[n["node"]] = (n, r["step"])
    if not loaded and not peak:
        return ""
    table = {}
    for node in dict.fromkeys([*loaded, *peak]):
        parts = []
        if node in loaded:
            n = loaded[node]
            parts.append(f"after loading {_gb(n['pss_bytes'])} (RSS summed {_gb(n['rss_bytes'])})")
        if node in peak:
            n, step = peak[node]
            parts.append(f"highest {_gb(n['pss_bytes'])} at step {step} (RSS summed {_gb(n['rss_bytes'])})")
        n = peak.get(node, (loaded.get(node), 0))[0]
        table[node] = f"PSS {' · '.join(parts)}, {n['measured_ranks']} rank(s), private {_gb(n['private_bytes'])}"
    caption = (
        "The sum of the PSS of each node's ranks: what the node holds for them, each page shared by several ranks "
        "counted once. The sum of their RSS counts a shared page once per rank that maps it."
    )
    if shared:
        parts = ", ".join(f"{name} {_gb(n)}" for name, n in shared.items())
        caption += (
            f" The frozen weights were mapped from one file per node that all its ranks share (--share_weights): "
            f"{parts}; {_gb(sum(shared.values()))} per node instead of per rank."
        )
    return f"<h2>Memory per node</h2><p>{caption}</p>{html_table(table)}"


def _cpu_use_section(rows: list[dict], figs: dict) -> str:
    util = {
        n: f"mean {_pct(d['mean'])}, lowest {_pct(d['lowest'])} (ranks {', '.join(map(str, d['ranks']))})"
        for n, d in figs["cpu_util"].items()
    }
    layout = figs.get("layout_verdict")
    # Every node equally low is the layout against the cores (the test cluster's ranks share one machine's cores),
    # which the trainer names; a node low on its own is a straggler (the section below).
    why = (
        f"Every node is equally low, and the trainer said why: {layout['text']}"
        if layout
        else "A node under the dashed line while the others are above it is a straggler (below)."
    )
    caption = (
        "Each rank's process CPU time ÷ (wall time × its threads) over each stats interval, averaged over the "
        f"node's ranks. {why}"
    )
    png = clusterview.utilisation_png(rows)
    return _figure_section("CPU use per node", png, "CPU utilisation per node over the run", caption, util)


def _time_split_section(rows: list[dict], figs: dict) -> str:
    split = {
        n: f"compute {d['compute_s']:.3f} s · all-reduce {d['allreduce_s']:.3f} s · data {d['data_s']:.3f} s"
        for n, d in figs["time_split_s_per_step"].items()
    }
    caption = (
        "Seconds per step. A fast node waits in the all-reduce for the slowest one: a long all-reduce bar beside a "
        "long compute bar points at the straggler."
    )
    png = clusterview.split_png(rows)
    return _figure_section(
        "Where the step time goes", png, "compute, all-reduce and data time per node", caption, split
    )


def _figure_section(title: str, png: str, alt: str, caption: str, table: dict) -> str:
    """A heading, a plot (a data: URL) with its caption, and the per-node table under it."""
    return f"<h2>{title}</h2>{figure(png, alt, caption)}{html_table(table)}"


def _stragglers_section(rows: list[dict], figs: dict) -> str:
    """Every node low on CPU (the layout or the shared load) once; each straggler with why it is one and its likely
    causes; else the rule every node met."""
    found = figs["stragglers"]
    thresholds = clusterview.stats_rows(rows)[-1]["rank_stats"].get("thresholds") or {}
    layout = figs.get("layout_verdict")
    verdict = (
        f"<p class=verdict><b>Low CPU on every node</b> (from step {layout['first_step']}): "
        f"{html.escape(layout['text'])}</p>"
        if layout
        else ""
    )
    if found:
        items = "".join(
            f"<li><b>{html.escape(s['node'])}</b> (ranks {', '.join(map(str, s['ranks']))}), from step "
            f"{s['first_step']}: {html.escape('; '.join(s['why']))}. Likely causes, most likely first:<ol>"
            + "".join(f"<li>{html.escape(c)}</li>" for c in s["causes"])
            + "</ol></li>"
            for s in found
        )
        return f"<h2>Stragglers</h2>{verdict}<ul class=stragglers>{items}</ul>"
    rule = (
        f" (every node at or above {_pct(thresholds['cpu_util'])} CPU and within "
        f"{thresholds['compute_ratio']}× the median compute time)"
        if thresholds
        else ""
    )
    if layout:
        return f"<h2>Stragglers</h2>{verdict}<p>No node lags the others.</p>"
    return f"<h2>Stragglers</h2><p>No straggler{html.escape(rule)}.</p>"


def _cost_sections(cost: dict) -> list[str]:
    """What the run cost, and the same job on a GPU instance where one is priced."""
    cur = cost["currency"]
    table = {
        "node-hours": f"{cost['node_hours']:.3f} ({cost['nodes']} nodes)",
        "price per node-hour": _money(cost["node_hour_price"], cur),
        "training": _money(cost["training_cost"], cur),
        "per 100 steps": _money(cost["cost_per_100_steps"], cur) + f" (median {cost['s_per_step']} s/step)",
    }
    if "cost_per_generated_image" in cost:
        table["per generated image (one node)"] = _money(cost["cost_per_generated_image"], cur)
    sections = ["<h2>Cost</h2>" + html_table(table)]
    gpu = cost.get("gpu")
    if gpu:
        head = "<tr><th></th><th>this cluster</th><th>GPU instance</th><th>GPU ÷ cluster</th></tr>"
        body = (
            f"<tr><th>price per hour</th><td>{_money(gpu['cluster_hour_price'], cur)}</td>"
            f"<td>{_money(gpu['gpu_hour_price'], cur)}</td><td>{gpu['price_ratio_gpu_to_cluster']}×</td></tr>"
            f"<tr><th>s/step</th><td>{cost['s_per_step']}</td><td>{gpu['gpu_s_per_step']}</td>"
            f"<td>{gpu['gpu_s_per_step'] / cost['s_per_step']:.3g}×</td></tr>"
            f"<tr><th>cost per 100 steps</th><td>{_money(cost['cost_per_100_steps'], cur)}</td>"
            f"<td>{_money(gpu['gpu_cost_per_100_steps'], cur)}</td><td>{gpu['cost_ratio_gpu_to_cluster']}×</td>"
            "</tr>"
        )
        sections.append(f"<h3>Against a GPU for the same job</h3><table>{head}{body}</table>")
    return sections
