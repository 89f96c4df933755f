"""The playbook runner the cluster tests use: a run's stats, failures and output come back as data, with the
repository's own callbacks and settings in force (no cluster needed: one play on localhost)."""

from __future__ import annotations

from pathlib import Path

from runner import TaskFailure, run_playbook

PLAY = """\
- name: A play with one of each outcome
  hosts: all
  gather_facts: false
  tasks:
    - name: Say what the run's environment keeps
      ansible.builtin.debug:
        msg: "host key checking {{ lookup('ansible.builtin.env', 'ANSIBLE_HOST_KEY_CHECKING') }}"
    - name: Fail but be ignored
      ansible.builtin.command: /bin/false
      changed_when: false
      ignore_errors: true
    - name: Refuse with a reason
      ansible.builtin.assert:
        that: item == 1
        fail_msg: "item {{ item }}: the reason, in words. Fix: do this."
        quiet: true
      loop: [1, 2]
    - name: Never reached
      ansible.builtin.debug:
        msg: unreachable
"""


def test_a_run_reports_its_failures_stats_and_timings_as_data(tmp_path: Path) -> None:
    playbook = tmp_path / "play.yml"
    playbook.write_text(PLAY)
    inventory = tmp_path / "hosts.ini"
    inventory.write_text("localhost ansible_connection=local ansible_python_interpreter=auto_silent\n")
    result = run_playbook(str(playbook), inventory, "-e", "unused=1", state_dir=tmp_path / "state", name="one-of-each")
    assert result.rc == 2, result.tail()
    assert result.failures() == [
        TaskFailure("localhost", "Refuse with a reason", "item 2: the reason, in words. Fix: do this.")
    ]
    assert result.recap == {
        "localhost": {"ok": 2, "changed": 0, "unreachable": 0, "failed": 1, "skipped": 0, "rescued": 0, "ignored": 1}
    }
    said = [e["event_data"]["res"].get("msg") for e in result.events if e.get("event") == "runner_on_ok"]
    assert "host key checking True" in said  # ansible-runner would turn checking off if we let it
    assert "TASK TIMINGS" in result.output  # the repository's callback plugins are still loaded
    assert "Never reached" not in result.output
    assert result.log.read_text() == result.output
