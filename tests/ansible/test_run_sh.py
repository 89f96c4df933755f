"""The finetune role's job script (roles/finetune/templates/run.sh.j2), rendered the way the role renders it and
launched the way launch.yml launches it (flock --no-fork): a SIGTERM to it reaches every rank through
mpiexec.hydra, the ranks stop cleanly, and exit.json records the stop. Real mpiexec.hydra, 2 ranks, tiny model."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import jinja2
from cli_runs import mpi_env, train_args
from repo_code import REPO, VENV_BIN, write_wrapper

from xeonsd.cluster import job_status


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


def test_sigterm_to_run_sh_stops_every_rank_cleanly_and_exit_json_says_so(tiny_model, dataset, tmp_path, cli_env):
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
    argv = ["flock", "--nonblock", "--no-fork", str(run_dir.parent / ".lock"), "/bin/bash", str(script)]
    # Its own process group: run.sh, mpiexec.hydra and the ranks, all ended on the way out if the test fails.
    job = subprocess.Popen(
        argv, env=mpi_env(cli_env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    metrics = run_dir / "metrics.partial.jsonl"
    try:
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.read_text().strip()):
            log = run_dir / "train.log"
            assert job.poll() is None, log.read_text()[-3000:] if log.exists() else "no train.log"
            assert time.monotonic() < deadline, "no training step within 240 s"
            time.sleep(0.05)
        pid = int((run_dir / "run.pid").read_text())
        assert pid == job.pid, "flock --no-fork: run.sh is the launched process, so the signal reaches it"
        os.kill(pid, signal.SIGTERM)
        rc = job.wait(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    log = (run_dir / "train.log").read_text()
    assert rc == 143, log[-3000:]
    ended = job_status.read_exit(run_dir)
    assert ended is not None and ended.rc == 143 and ended.attempt == 1, ended
    stop = ended.stopped
    assert stop is not None and (stop.signal, stop.reason) == ("SIGTERM", "signal") and stop.step >= 1, ended
    assert stop.checkpoint == f"checkpoint-{stop.step}" and (run_dir / stop.checkpoint / "trainer_state.pt").is_file()
    statuses = [json.loads(p.read_text()) for p in sorted((run_dir / "status").glob("rank-*.json"))]
    assert [(s["state"], s["step"], s["attempt"]) for s in statuses] == [("interrupted", stop.step, 1)] * 2
    assert f"[0] xeonsd train: stopped by SIGTERM at step {stop.step}" in log
