"""Nodes that share their home directory (docs/playbooks.md#shared-home), on the provisioned test cluster switched to
its shared-home mode (tests/cluster/shared_home.py: one host directory as every node's home, the env and the caches
still each node's own).

Then doctor.yml on the shared home (it says so, and every check passes). One test, to keep within the CI budget: the nodes keep the env and caches they were provisioned with (node-local
disk, untouched by the switch), so the provision in shared-home mode only has the home to fill; it runs with the
tags of the concerns that write there, and so does the second run (changed=0, nothing under the home touched); a
whole provision's second run is test_provision's."""

from __future__ import annotations

import json
from pathlib import Path

from harness import NODES, Cluster
from namespaces import tree_stats
from runner import PlaybookRun, run_playbook
from test_doctor_play import report as doctor_report
from test_doctor_play import rows as doctor_rows

# The tasks that write under the home: on a shared home, they run on the primary only.
HOME = "/home/devcloud"  # the cluster account's home (group_vars/cluster.yml)
RANKS = 2 * NODES  # the job on the shared home: two ranks per node
HOME_WRITES = (
    "Create the tree's directory - ",
    "Unpack the tree where the node's files differ from the controller's - ",
    "cluster_user : Own the home directory",
    "cluster_user : Create ~/.ssh",
    "mpi : Authorize the cluster key",
    "mpi : Use the cluster key for the cluster's addresses",
)


def hosts_that_ran(run: PlaybookRun, task_prefix: str) -> dict[str, set[str]]:
    """{task name: hosts it ran on (not skipped)} for the tasks whose name (after the role) starts with the prefix."""
    ran: dict[str, set[str]] = {}
    for e in run.events:
        data = e.get("event_data", {})
        task = data.get("task", "")
        if e.get("event") in ("runner_on_ok", "runner_on_failed") and task_prefix in f"{data.get('role', '')} : {task}":
            ran.setdefault(task, set()).add(data["host"])
    return ran


def test_shared_home_is_written_once_by_the_primary_and_the_job_trains(provisioned: Cluster, tmp_path: Path) -> None:
    home = provisioned.shared_home_dir
    provisioned.share_home()
    try:
        inventory = provisioned.write_inventory(tmp_path / "inventory.yml")  # shared_home: auto
        first = run_playbook(
            "provision.yml",
            inventory,
            "--tags",
            "cluster_user,dataset,base_model,mpi",
            state_dir=provisioned.state_dir,
            name="shared-home-provision",
        )
        assert first.rc == 0, first.tail()
        assert "Every node sees the primary's /home/devcloud: a shared home." in first.output
        # Written once: every task that writes under the home ran on the primary alone; the others only checked.
        for prefix in HOME_WRITES:
            ran = hosts_that_ran(first, prefix)
            assert ran and all(hosts == {"node1"} for hosts in ran.values()), (prefix, ran)
        # mpi writes each node's own files in one module run; known_hosts (under the home) is in node1's alone.
        home_files = {
            e["event_data"]["host"]: [f for f in e["event_data"]["res"].get("written", []) if f.startswith(HOME)]
            for e in first.events
            if e.get("event") == "runner_on_ok" and e["event_data"].get("task", "").startswith("Write the nodefile")
        }
        assert home_files == {n: [f"{HOME}/.ssh/known_hosts"] if n == "node1" else [] for n in provisioned.nodes}
        checked = hosts_that_ran(first, "Check the node's files against the controller's")
        assert len(checked) == 2 and all(len(hosts) == NODES for hosts in checked.values()), checked
        for node in provisioned.nodes:  # every node sees the one copy, and trusts the cluster key through it
            provisioned.ssh(
                node, "test -f /home/devcloud/dicoo/metadata.jsonl -a -f /home/devcloud/models/tiny-sd/model_index.json"
            )
            out = provisioned.ssh(node, f"ssh {provisioned.address(NODES)} hostname -I", user="devcloud").stdout
            assert provisioned.address(NODES) in out.split()

        runs = provisioned.state_dir / "runs"
        # Two ranks per node: ranks of one node and of different nodes write into the one run directory.
        # a table: each -e beside its value (ruff would put one item per line)
        job = run_playbook("playbooks/train.yml", inventory, "-e", "finetune_max_train_steps=2",
                           "-e", "finetune_checkpointing_steps=2", "-e", "finetune_run_id=shared-home",
                           "-e", f"mpi_ranks={RANKS}", "-e", f"ranks_per_node={RANKS // NODES}",
                           "-e", f"controller_runs_dir={runs}", state_dir=provisioned.state_dir,
                           name="finetune-shared-home", timeout=1200)  # fmt: skip
        assert job.rc == 0, job.tail(60)
        assert f"{RANKS} ranks (gloo)" in job.output and (runs / "shared-home" / "train_summary.json").exists()
        # Each rank wrote its own status file into the one run directory: 8 paths, 4 nodes, no two ranks on one.
        status = [json.loads(p.read_text()) for p in (home / "runs" / "shared-home" / "status").glob("rank-*.json")]
        assert sorted(s["rank"] for s in status) == list(range(RANKS)), status
        assert len({s["address"] for s in status}) == NODES and {s["state"] for s in status} == {"done"}, status
        # Node-local: the env, pip's cache and the wheels are on each node's own disk, nothing of them in the home.
        for node in provisioned.nodes:
            cache = provisioned.node_dir(node) / "private" / "var/cache/xeonsd"
            assert (cache / "wheels").is_dir(), sorted(p.name for p in cache.iterdir())
        in_home = {p.relative_to(home).parts[0] for p in home.rglob("*")}
        assert not in_home & {"wheels", "wheelhouse", "pip-cache", "diffuser"}, in_home

        # doctor.yml on the shared home: every check passes, it says the home is shared, and it writes nothing there
        # (the second run below finds the shared files as doctor left them). Without the trial step: the job above
        # trained on the shared home, and the trial is test_doctor_play.py's (a minute of 2 cores per run). Its
        # mpirun hello with one rank per node: the 16-rank hello is test_doctor_play.py's too (12 rank starts less).
        before = tree_stats({"home": home / "dicoo", "model": home / "models", "ssh": home / ".ssh"})
        doctor = run_playbook(
            "doctor.yml",
            inventory,
            *("-e", "doctor_skip_train=true", "-e", "ranks_per_node=1", "-e", f"mpi_ranks={NODES}"),
            state_dir=provisioned.state_dir,
            name="doctor-shared-home",
            timeout=1500,
        )
        table = doctor_rows(doctor_report(doctor))
        assert doctor.rc == 0, doctor.tail(80)
        assert {status for status, _ in table.values()} <= {"PASS", "WARN"}, table
        status, detail = table[("cluster", "home")]
        assert status == "PASS" and detail.startswith("shared: every node sees node1's /home/devcloud"), detail
        assert doctor.changed() == {node: 0 for node in provisioned.nodes}, doctor.recap
        second = run_playbook(
            "provision.yml",
            inventory,
            "--tags",
            "cluster_user,dataset,base_model,mpi",
            state_dir=provisioned.state_dir,
            name="shared-home-second-run",
        )
        assert second.rc == 0, second.tail()
        assert second.changed() == {node: 0 for node in provisioned.nodes}, second.recap
        assert tree_stats({"home": home / "dicoo", "model": home / "models", "ssh": home / ".ssh"}) == before
    finally:
        provisioned.share_home(False)
