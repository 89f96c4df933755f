"""The screen output of a wait with ``until`` (plugins/callback/xeonsd_console.py beside xeonsd_progress.py), from a
real ansible-playbook run on this machine with the repository's ansible.cfg: the training job's poll that only
waits prints its progress line and no FAILED line; an attempt that fails still prints FAILED with its message; any
other task's wait prints WAITING. The poll is a stand-in module with the finetune role's module name (xeonsd_job),
which answers from a counter file: step n/3 on the n-th call, finished on the third, and from the second on the
trainer's verdict that every node is low on CPU, which the play prints once."""

from __future__ import annotations

import os
import re
import subprocess
import textwrap
from pathlib import Path

import yaml
from repo_code import REPO, VENV_BIN

FAKE_JOB = textwrap.dedent(
    """\
    #!/usr/bin/python
    from ansible.module_utils.basic import AnsibleModule

    module = AnsibleModule(argument_spec={"counter": {"type": "path"}, "fail_at": {"type": "int", "default": 0}})
    path = module.params["counter"]
    try:
        n = int(open(path).read()) + 1
    except OSError:
        n = 1
    open(path, "w").write(str(n))
    if n == module.params["fail_at"]:
        module.fail_json(msg=f"cannot read the job's state: poll {n} broke")
    layout = "all 4 nodes equally low on CPU (fake)" if n >= 2 else None
    module.exit_json(finished=n >= 3, msg=f"step {n}/3 (fake progress)", layout_warning=layout)
    """
)


def _run(tmp_path: Path, fail_at: int = 0) -> str:
    library = tmp_path / "library"
    library.mkdir(exist_ok=True)
    (library / "xeonsd_job.py").write_text(FAKE_JOB)
    play = [
        {
            "hosts": "localhost",
            "connection": "local",
            "gather_facts": False,
            "tasks": [
                {
                    "name": "Training (a progress line every poll)",
                    "xeonsd_job": {"counter": str(tmp_path / f"count-{fail_at}"), "fail_at": fail_at},
                    "register": "job",
                    "until": "job.finished | default(false)",
                    "retries": 5,
                    "delay": 0,
                },
                {
                    "name": "Wait for a file",
                    "ansible.builtin.command": {
                        "argv": ["bash", "-c", f"echo x >> {tmp_path}/w; wc -l < {tmp_path}/w"]
                    },
                    "register": "w",
                    "until": "w.stdout | int >= 2",
                    "retries": 3,
                    "delay": 0,
                    "changed_when": False,
                },
            ],
        }
    ]
    playbook = tmp_path / f"play-{fail_at}.yml"
    playbook.write_text(yaml.safe_dump(play, sort_keys=False))
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_LIBRARY": str(library),
        "ANSIBLE_PYTHON_INTERPRETER": str(VENV_BIN / "python"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp"),
    }
    done = subprocess.run(
        [str(VENV_BIN / "ansible-playbook"), "-i", "localhost,", str(playbook)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    return said


def test_a_poll_that_only_waits_prints_its_progress_line_and_no_failed_line(tmp_path: Path) -> None:
    said = _run(tmp_path)
    assert "FAILED" not in said, said
    assert "RETRYING" not in said, said
    assert "  localhost: step 1/3 (fake progress)" in said, said
    assert "  localhost: step 2/3 (fake progress)" in said, said
    # The verdict that every node is low on CPU comes with every poll from the second on: printed once.
    assert said.count("[WARNING]: Low CPU on every node: all 4 nodes equally low on CPU (fake)") == 1, said
    # Another task's wait says that it waits, once per repeat.
    assert len(re.findall(r"^WAITING: \[localhost\]: Wait for a file \(\d+ retries left\)\.$", said, re.M)) == 1, said


def test_a_poll_that_fails_still_prints_failed_with_its_message(tmp_path: Path) -> None:
    said = _run(tmp_path, fail_at=2)
    failed = r"^FAILED - RETRYING: \[localhost\]: Training \(a progress line every poll\) \(\d+ retries left\)\. "
    assert re.search(failed + "cannot read the job's state: poll 2 broke$", said, re.M), said
    assert said.count("FAILED - RETRYING") == 1 and said.count("poll 2 broke") == 1, said  # once, not twice
    assert "  localhost: step 1/3 (fake progress)" in said, said
