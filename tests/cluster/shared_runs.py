"""Finished runs that several test files use, made once per session on the session's cluster.

In the whole suite the files run in file order on one cluster, and a run that a later file needs is already made by
an earlier file's test (test_finetune_e2e.py's run is the textual-inversion run whose base-model export
test_finetune_methods.py's LoRA run reuses; that LoRA run is what test_serve.py serves). Run alone, a file finds no
such run: the fixtures in conftest.py then make a small one with the same run id, and otherwise hand back the one
that is there, so the whole suite does no extra work.

A run counts when the controller holds its fetched ``run.json`` and node1, the primary, holds both its run directory
and its export: the controller's runs directory outlives the session, the nodes do not.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from harness import Cluster
from jobs import RUNS, controller_runs
from runner import run_playbook

# A run made for reuse: 2 steps on 4 ranks, one per node (a 16-rank start costs about a minute on 2 cores); the
# export and the images keep the inventory's settings, so the export is the one a full-size run makes.
SMALL_RUN = ("-e", "finetune_max_train_steps=2", "-e", "finetune_checkpointing_steps=2")
ONE_RANK_PER_NODE = ("-e", "ranks_per_node=1", "-e", "mpi_ranks=4")


def finished_run(cluster: Cluster, run_id: str) -> Path | None:
    """The run's directory on the controller when this session's cluster made it, else None."""
    run = controller_runs(cluster) / run_id
    if not (run / "run.json").exists():
        return None
    export_dir = json.loads((run / "run.json").read_text()).get("export", {}).get("dir")
    if not export_dir:
        return None
    on_node1 = cluster.ssh("node1", f"test -d {RUNS}/{run_id} && test -f {export_dir}/xeonsd_export.json", check=False)
    return run if on_node1.returncode == 0 else None


def ensure_run(cluster: Cluster, run_id: str, *args: str) -> Path:
    """The finished run ``run_id`` of this session: the one an earlier test made, or a small one made now with
    finetune.yml and ``args``."""
    found = finished_run(cluster, run_id)
    if found is not None:
        return found
    runs = controller_runs(cluster)
    shutil.rmtree(runs / run_id, ignore_errors=True)  # an earlier session's copy: its cluster is gone
    result = run_playbook(
        "finetune.yml",
        cluster.inventory,
        *("-e", f"controller_runs_dir={runs}", "-e", f"finetune_run_id={run_id}"),
        *SMALL_RUN,
        *ONE_RANK_PER_NODE,
        *args,
        state_dir=cluster.state_dir,
        name=f"finetune-{run_id}-for-reuse",
        timeout=1800,
    )
    assert result.rc == 0, f"finetune.yml for the shared run {run_id!r} failed:\n{result.tail(80)}"
    made = finished_run(cluster, run_id)
    assert made is not None, f"finetune.yml passed but run {run_id!r} is not on node1 and the controller"
    return made
