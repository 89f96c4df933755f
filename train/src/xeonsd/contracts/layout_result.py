"""The rank layouts of one node and the tuning result that ``ranks_per_node: auto`` reads: defined here once.

A layout is ranks per node × threads per rank that together use the node's physical cores (on 2 cores 1×2 and
2×1; on 56 cores 1×56, 2×28, 4×14, 7×8, 8×7, 14×4, 28×2, 56×1). ``xeonsd bench layout`` (:mod:`xeonsd.bench.layout`)
measures each with the job's own training arguments and writes the result below; doctor.yml -e tune_layout=true
stores it on the controller (``runs/layout.json``), and the playbooks' filter (``plugins/filter/xeonsd_layout.py``,
which loads this file on the controller) turns ``ranks_per_node: auto`` into its best layout. Standard library only.

The result (one JSON object)::

    {"schema": "xeonsd-layout/1", "node": "node1", "cores": 2, "measured": "2026-12-01T17:00:00Z",
     "rounds": 2, "steps": 2, "train_args": [...],
     "layouts": [{"ranks_per_node": 1, "threads_per_rank": 2, "status": "measured",
                  "images_per_s": [0.20, 0.21], "median_images_per_s": 0.205, "ratio_to_first": 1.0,
                  "detail": ""}, ...],
     "best": {"ranks_per_node": 2, "threads_per_rank": 1, "images_per_s": 0.215}}

``images_per_s`` are per node (the node's ranks together), one per round; ``ratio_to_first`` is the median over
the rounds of this layout's images/s over the first layout's in the same round. A layout that was not measured
(it does not fit in memory) has ``status`` "skipped" and says why in ``detail``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

SCHEMA = "xeonsd-layout/1"
FILE_NAME = "layout.json"
AUTO = "auto"
FIX = "Fix: run ansible-playbook doctor.yml -e tune_layout=true (or set ranks_per_node to a number)"
# Training flags that differ from run to run and do not change a step's cost: a trial drops them, and a result
# measured with other values of them is not stale.
RUN_FLAGS = ("--validation_prompt", "--resume_from_checkpoint", "--world_size", "--output_dir", "--max_train_steps")


class LayoutError(ValueError):
    """The tuning result is missing, unreadable or not one this code wrote."""


def layouts(cores: int, only_ranks: Iterable[int] = ()) -> list[tuple[int, int]]:
    """(ranks per node, threads per rank) for every divisor of ``cores``, fewest ranks first; ``only_ranks``:
    just those ranks per node (each must divide ``cores``)."""
    if cores < 1:
        raise LayoutError(f"a node needs at least 1 physical core, not {cores}")
    every = [(r, cores // r) for r in range(1, cores + 1) if cores % r == 0]
    wanted = sorted(set(only_ranks))
    if not wanted:
        return every
    bad = [r for r in wanted if r < 1 or cores % r]
    if bad:
        choices = ", ".join(str(r) for r, _ in every)
        raise LayoutError(
            f"ranks per node {bad} do not split this node's {cores} physical cores evenly; choose from {choices}"
        )
    return [(r, t) for r, t in every if r in wanted]


def best_layout(measured: Sequence[Mapping]) -> Mapping:
    """The measured layout with the most images/s per node (the median over its rounds)."""
    done = [m for m in measured if m.get("status") == "measured"]
    if not done:
        raise LayoutError("no layout could be measured: " + "; ".join(str(m.get("detail", "")) for m in measured))
    return max(done, key=lambda m: m["median_images_per_s"])


def result_lines(result: Mapping) -> list[str]:
    """The result as the lines the CLI and the play print: one per layout, then the best."""
    lines = [
        f"{result['node']}: {result['cores']} physical cores, {result['rounds']} round(s) of {result['steps']} step(s)"
    ]
    for m in result["layouts"]:
        shape = f"{m['ranks_per_node']:>3} ranks x {m['threads_per_rank']:>3} threads"
        if m["status"] != "measured":
            lines.append(f"{shape}: skipped ({m['detail']})")
            continue
        rounds = " ".join(f"{v:.3f}" for v in m["images_per_s"])
        lines.append(
            f"{shape}: {m['median_images_per_s']:.3f} images/s per node (rounds {rounds}; "
            f"{m['ratio_to_first']:.2f}x the first layout)"
        )
    b = result["best"]
    lines.append(
        f"best: {b['ranks_per_node']} ranks per node x {b['threads_per_rank']} threads ({b['images_per_s']:.3f} images/s)"
    )
    return lines


def check(result: object, where: str = "the tuning result") -> dict:
    """``result`` when it is a tuning result of this schema with a usable best layout; else a LayoutError."""
    if not isinstance(result, dict) or result.get("schema") != SCHEMA:
        got = result.get("schema") if isinstance(result, dict) else type(result).__name__
        raise LayoutError(f"{where} is not an xeonsd layout result (schema {got!r}, expected {SCHEMA!r}). {FIX}")
    best = result.get("best")
    ranks = best.get("ranks_per_node") if isinstance(best, dict) else None
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise LayoutError(f"{where} has no best layout (best: {best!r}). {FIX}")
    return result


def read(path: str | Path) -> dict:
    """The tuning result at ``path``, checked."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise LayoutError(f"ranks_per_node is auto but there is no tuning result at {path}. {FIX}") from None
    except OSError as exc:
        raise LayoutError(f"cannot read the tuning result {path}: {exc}. {FIX}") from None
    try:
        result = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LayoutError(f"the tuning result {path} is not JSON ({exc}). {FIX}") from None
    return check(result, str(path))


def job_args(train_args: Iterable[str]) -> list[str]:
    """The training arguments that decide a step's cost: ``train_args`` without the :data:`RUN_FLAGS`."""
    return [str(a) for a in train_args if not str(a).startswith(RUN_FLAGS)]


def stale_reasons(result: Mapping, train_args: Sequence[str]) -> list[str]:
    """Why the tuning ``result`` may no longer hold for a job with ``train_args`` (empty: it holds): the method,
    resolution, batch or model it was measured with differ."""
    tuned, now = job_args(result.get("train_args") or []), job_args(train_args)
    then_only = [a for a in tuned if a not in now]
    now_only = [a for a in now if a not in tuned]
    if not then_only and not now_only:  # the same arguments, in any order
        return []
    return [
        f"it was measured with {' '.join(then_only) or 'no other arguments'}, "
        f"the job now has {' '.join(now_only) or 'none of them'}"
    ]


def stale_warning(path: str | Path, train_args: Sequence[str]) -> str:
    """The warning the play prints when ``ranks_per_node: auto`` reads a result measured for another job; "" when
    there is none to give (the result fits the job, or there is no result: :func:`read` fails for that)."""
    path = Path(path)
    if not path.exists():
        return ""
    result = read(path)
    reasons = stale_reasons(result, train_args)
    if not reasons:
        return ""
    return (
        f"WARNING: ranks_per_node is auto and uses the tuning result {path} (measured {result.get('measured', '?')}"
        f" on {result.get('node', '?')}), but {'; '.join(reasons)}: its best layout "
        f"({result['best']['ranks_per_node']} ranks per node) may not be the best for this job. "
        "Fix: run ansible-playbook doctor.yml -e tune_layout=true with the job's settings"
    )


def resolve_ranks_per_node(value: object, path: str | Path, missing: int | None = None) -> int:
    """``ranks_per_node`` as a number: itself, or with ``auto`` the best layout in the tuning result at ``path``
    (``missing``: what ``auto`` means while there is no result at all; None: an error that says to tune)."""
    if str(value).strip().lower() == AUTO:
        if missing is not None and not Path(path).exists():
            return int(missing)
        return int(read(path)["best"]["ranks_per_node"])
    try:
        ranks = int(str(value))
    except ValueError:
        raise LayoutError(f"ranks_per_node must be a number or auto, not {value!r}") from None
    if ranks < 1:
        raise LayoutError(f"ranks_per_node must be at least 1, not {ranks}")
    return ranks


def resolve_mpi_ranks(value: object, nodes: int, ranks_per_node: int) -> int:
    """``mpi_ranks`` as a number: itself, or with ``auto`` the nodes × ``ranks_per_node``."""
    if str(value).strip().lower() == AUTO:
        return nodes * int(ranks_per_node)
    try:
        return int(str(value))
    except ValueError:
        raise LayoutError(f"mpi_ranks must be a number or auto, not {value!r}") from None
