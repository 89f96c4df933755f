"""The inventory the harness writes (no cluster needed: Ansible reads it on the controller): the test cluster's
settings come from group_vars/cluster.yml, the nodes' private directories are the ones the repository's inventory
names, and the per-run values and a test's overrides are in force."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cluster_inventory import SETTINGS_FILE, inventory_variables, load_mapping, resolve
from harness import Cluster, State
from runner import run_playbook

PLAY = """\
- name: Show what the nodes get
  hosts: cluster
  gather_facts: false
  tasks:
    - name: Show the variables
      ansible.builtin.debug:
        msg:
          private_dirs: "{{ [diffuser_env_prefix, cluster_user_home, xeonsd_etc_dir, xeonsd_cache_dir] }}"
          settings: "{{ dict(settings_names | zip(settings_names | map('extract', vars))) }}"
          mpi_ranks: "{{ mpi_ranks }}"
          key: "{{ ansible_ssh_private_key_file }}"
          primary: "{{ groups['primary'] }}"
"""


def test_ansible_sees_the_settings_the_node_paths_and_the_run_values(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "state", prefix="xsdu", subnet=9)
    cluster._save(State(prefix="xsdu", subnet=9, nodes=["node1", "node2", "node3"]))
    inventory = cluster.write_inventory(tmp_path / "inv" / "inventory.yml", overrides={"finetune_poll_s": 1})
    playbook = tmp_path / "play.yml"
    playbook.write_text(PLAY)
    settings = load_mapping(SETTINGS_FILE)
    extra = json.dumps({"settings_names": sorted(settings), "ansible_connection": "local"})
    result = run_playbook(str(playbook), inventory, "-e", extra, state_dir=tmp_path / "ansible", name="inventory")
    assert result.rc == 0, result.tail()

    shown = {
        e["event_data"]["host"]: e["event_data"]["res"]["msg"]
        for e in result.events
        if e.get("event") == "runner_on_ok"
    }
    assert sorted(shown) == ["node1", "node2", "node3"]
    # a setting may name another inventory variable (serve_state_dir: under xeonsd_cache_dir): as Ansible renders it
    rendered = {name: resolve(name, inventory_variables()) for name in settings}
    for node, msg in shown.items():
        assert msg["private_dirs"] == list(cluster.private_dirs), node
        assert msg["settings"] == {**rendered, "finetune_poll_s": 1}, node
        assert int(msg["mpi_ranks"]) == settings["ranks_per_node"] * 3, node
        assert msg["key"] == str(cluster.admin_key), node
        assert msg["primary"] == ["node1"], node


def test_a_node_path_that_needs_more_than_the_inventory_is_refused_by_name() -> None:
    assert resolve("home", {"user": "devcloud", "home": "/home/{{ user }}"}) == "/home/devcloud"
    with pytest.raises(ValueError, match=r"^env_dir: cannot render '\{\{ role_path \}\}/env'"):
        resolve("env_dir", {"env_dir": "{{ role_path }}/env"})
    with pytest.raises(KeyError, match="nowhere is not set in"):
        resolve("nowhere", {})


def test_a_settings_file_that_is_not_a_mapping_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "cluster.yml"
    bad.write_text("---\n- ranks_per_node\n")
    with pytest.raises(ValueError, match="expected a mapping of variable names to values, got list"):
        load_mapping(bad)
