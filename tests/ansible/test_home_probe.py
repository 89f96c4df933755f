"""The home_probe role (preflight's shared_home check and doctor's home row both use it), run for real on this
machine: two inventory nodes here see one home (shared), a node alone has no one to share it with, an account that
does not exist yet is not probed and says so, and the probe leaves nothing behind and changes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from repo_code import REPO, VENV_BIN


def probe(tmp_path: Path, nodes: list[str], user: str) -> tuple[dict, str]:
    """home_probe_result as the play's nodes (all on this machine, the first the primary) found it, and the recap."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    inventory = {
        "all": {
            "vars": {
                "ansible_connection": "local",
                "ansible_python_interpreter": sys.executable,
                "ansible_become": False,
            },
            "children": {
                "cluster": {"hosts": {n: {} for n in nodes}},
                "primary": {"hosts": {nodes[0]: {}}},
            },
        }
    }
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inventory))
    out = tmp_path / "result.json"
    play = [
        {
            "hosts": "cluster",
            "gather_facts": False,
            "tasks": [
                {
                    "name": "Probe",
                    "ansible.builtin.import_role": {"name": "xeonsd.cluster.home_probe"},
                    "vars": {"home_probe_dir": str(home), "home_probe_user": user},
                },
                {
                    "name": "Write what it found",
                    "ansible.builtin.copy": {"content": "{{ home_probe_result | to_json }}", "dest": str(out)},
                    "delegate_to": "localhost",
                    "run_once": True,
                    "changed_when": False,
                },
            ],
        }
    ]
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play))
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1", ANSIBLE_CACHE_PLUGIN="memory")
    proc = subprocess.run(
        [str(VENV_BIN / "ansible-playbook"), "-i", str(tmp_path / "hosts.yml"), str(tmp_path / "play.yml")],
        cwd=REPO,
        env=env,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not list(home.iterdir()), "the probe file was left behind"
    return json.loads(out.read_text()), proc.stdout


def test_nodes_that_see_one_home_are_found_sharing_it(tmp_path: Path) -> None:
    found, recap = probe(tmp_path, ["node1", "node2", "node3"], "root")
    assert found == {
        "dir": str(tmp_path / "home"),
        "probed": True,
        "why": "",
        "others": ["node2", "node3"],
        "seen": ["node2", "node3"],
        "shared": True,
    }
    assert recap.count("changed=0") == 3, recap


def test_a_node_alone_is_probed_but_shares_with_no_one(tmp_path: Path) -> None:
    found, _ = probe(tmp_path, ["node1"], "root")
    assert (found["probed"], found["others"], found["seen"], found["shared"]) == (True, [], [], False)


def test_an_account_that_does_not_exist_yet_is_not_probed_and_says_so(tmp_path: Path) -> None:
    found, _ = probe(tmp_path, ["node1", "node2"], "xeonsd-no-such-user")
    assert (found["probed"], found["seen"], found["shared"]) == (False, [], False)
    assert found["why"] == "xeonsd-no-such-user has no account on node1"
