"""The finetune role's job script (roles/finetune/templates/run.sh.j2), rendered the way the role renders it and
launched the way launch.yml launches it (async flock --no-fork), its progress read by the role's xeonsd_job poll
(with its action plugin and the xeonsd_progress callback) in a local play: a Ctrl-C on ansible-playbook does not end
the play but stops the job. The next poll sends run.sh SIGTERM (`xeonsd jobstatus stop`), it reaches every rank
through mpiexec.hydra, the ranks stop cleanly, exit.json records the stop and the poll reports it. Real
mpiexec.hydra, 2 ranks, tiny model."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import jinja2
import yaml
from cli_runs import mpi_env, train_args
from repo_code import REPO, VENV_BIN, write_wrapper

from xeonsd.contracts import job_status


def _render_run_sh(run_dir: Path, wrapper: Path, nodefile: Path, args: list[str]) -> Path:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["quote"] = shlex.quote
    template = env.from_string((REPO / "roles" / "finetune" / "templates" / "run.sh.j2").read_text())
    script = run_dir / "run.sh"
    script.write_text(
        template.render(
            ansible_managed="Ansible managed",
            inventory_hostname="node1",
            finetune_run_name=run_dir.name,
            finetune_user="devcloud",
            finetune_runs_dir=str(run_dir.parent),
            finetune_run_dir=str(run_dir),
            finetune_setup_timeout_s=300,
            finetune_step_timeout_s=60,
            finetune_node_names_env="127.0.0.1=node1",
            finetune_shared_cores=0,
            finetune_timeout_s=3600,
            finetune_stop_timeout_s=60,
            finetune_env_wrapper=str(wrapper),
            finetune_nodefile=str(nodefile),
            finetune_ranks=2,
            finetune_ranks_per_node=2,
            finetune_args=args,
            finetune_resume="",
        )
    )
    return script


def _play(tmp_path: Path, run_dir: Path, wrapper: Path) -> Path:
    """launch.yml's launch and wait.yml's poll (every second), on this machine; the poll's last answer to a file."""
    play = [
        {
            "hosts": "localhost",
            "connection": "local",
            "gather_facts": False,
            "tasks": [
                {
                    "name": "Launch the training job in the background",
                    "ansible.builtin.command": {
                        "argv": [
                            "flock",
                            "--nonblock",
                            "--no-fork",
                            str(run_dir.parent / ".lock"),
                            "/bin/bash",
                            str(run_dir / "run.sh"),
                        ],
                    },
                    "async": 600,
                    "poll": 0,
                    "register": "launch",
                },
                {
                    "name": "Training (a progress line every poll)",
                    "xeonsd.cluster.xeonsd_job": {
                        "env_wrapper": str(wrapper),
                        "run_dir": str(run_dir),
                        "results_file": "{{ launch.results_file }}",
                        "node_names": ["node1"],
                        "node_addresses": ["127.0.0.1"],
                        "ranks_per_node": 2,
                        "total_steps": 100000,
                    },
                    "register": "job",
                    "until": "job.finished",
                    "retries": 300,
                    "delay": 1,
                },
                {"ansible.builtin.copy": {"content": "{{ job | to_json }}", "dest": str(tmp_path / "job.json")}},
            ],
        }
    ]
    path = tmp_path / "play.yml"
    path.write_text(yaml.safe_dump(play, sort_keys=False))
    return path


def _ansible_env(cli_env: dict) -> dict:
    return {
        **mpi_env(cli_env),
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_PYTHON_INTERPRETER": str(VENV_BIN / "python"),
        "ANSIBLE_NOCOLOR": "1",
        "PYTHONUNBUFFERED": "1",
    }


def _wait_for_a_step(run_dir: Path, play: subprocess.Popen, output: Path) -> None:
    metrics = run_dir / "metrics.partial.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().strip()):
        log = run_dir / "train.log"
        assert play.poll() is None, output.read_text()[-3000:] + (log.read_text()[-3000:] if log.exists() else "")
        assert time.monotonic() < deadline, "no training step within 240 s"
        time.sleep(0.05)


def test_ctrl_c_on_the_play_stops_every_rank_cleanly_and_the_poll_reports_it(tiny_model, dataset, tmp_path, cli_env):
    etc = tmp_path / "etc"
    etc.mkdir()
    wrapper = write_wrapper(etc)
    (etc / "env.sh").write_text(f"export PATH={shlex.quote(str(VENV_BIN))}:$PATH\n")
    nodefile = etc / "nodefile"
    nodefile.write_text("localhost\n")
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    args = [
        a for a in train_args(tiny_model, dataset, run_dir, "--log_every=1", steps=100000) if "--output_dir" not in a
    ]
    script = _render_run_sh(run_dir, wrapper, nodefile, args)
    assert " mpiexec.hydra -l -f " in script.read_text()
    output = tmp_path / "play.log"
    argv = [str(VENV_BIN / "ansible-playbook"), "-i", "localhost,", str(_play(tmp_path, run_dir, wrapper))]
    # Its own process group, as a terminal's foreground job: a Ctrl-C is SIGINT to the whole group.
    with open(output, "w") as out:
        play = subprocess.Popen(
            argv, cwd=REPO, env=_ansible_env(cli_env), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_for_a_step(run_dir, play, output)
        os.killpg(play.pid, signal.SIGINT)
        rc = play.wait(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(play.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, ValueError, FileNotFoundError):
            os.killpg(int((run_dir / "run.pid").read_text()), signal.SIGKILL)  # async_wrapper's session: the job's
    said, log = output.read_text(), (run_dir / "train.log").read_text()
    assert rc == 0, said[-4000:]  # the play went on after the Ctrl-C, until the job's end
    pid = int((run_dir / "run.pid").read_text())
    assert "[xeonsd] Ctrl-C: stopping the training job cleanly" in said, said[-4000:]
    assert f"localhost: SIGTERM sent to the job (run.sh, pid {pid})" in said, said[-4000:]
    ended = job_status.read_exit(run_dir)
    assert ended is not None and ended.rc == 143 and ended.attempt == 1, (ended, log[-3000:])
    stop = ended.stopped
    assert stop is not None and (stop.signal, stop.reason) == ("SIGTERM", "signal") and stop.step >= 1, ended
    assert stop.checkpoint == f"checkpoint-{stop.step}" and (run_dir / stop.checkpoint / "trainer_state.pt").is_file()
    statuses = [json.loads(p.read_text()) for p in sorted((run_dir / "status").glob("rank-*.json"))]
    assert [(s["state"], s["step"], s["attempt"]) for s in statuses] == [("interrupted", stop.step, 1)] * 2
    assert f"[0] xeonsd train: stopped by SIGTERM at step {stop.step}" in log
    polled = json.loads((tmp_path / "job.json").read_text())  # the poll's answer once the job ended
    assert polled["exit_code"] == 143 and polled["failure"]["stopped"]["step"] == stop.step, polled
    # The stop was asked for once: the interrupt file is gone, and no later poll signalled run.sh again.
    assert said.count("SIGTERM sent to the job") == 1
    assert not list(Path(tempfile.gettempdir()).glob(f"xeonsd-interrupt-{play.pid}"))
