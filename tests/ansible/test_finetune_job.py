"""The finetune role's side of the job's files: its modules ask the node's xeonsd (`xeonsd jobstatus poll|ranks`,
through the mpi role's wrapper) and its tasks take the exit codes from `xeonsd jobstatus codes`, so the files'
schema and the codes are defined once, in xeonsd.contracts.job_status. The command lines run here for real, through
the rendered wrapper, against the package's CLI."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from repo_code import REPO, VENV_BIN, ansible_code, write_wrapper

from xeonsd.contracts import job_status as jobstatus
from xeonsd.contracts.job_status import RankStatus
from xeonsd.jobs import attempts
from xeonsd.jobs.status_file import RankStatusFile

# The modules' command lines and how they read the answer, not the Ansible modules (see repo_code.ansible_code).
joblog = ansible_code("xeonsd_joblog")
ROLE = REPO / "roles" / "finetune"
# The finetune role's node-side Python (in plugins/, the one home): its job modules and what builds their command
# lines. The action plugin is controller-side: it handles Ansible's own results, not the job's files.
JOB_CODE = [
    REPO / "plugins" / "modules" / "xeonsd_job.py",
    REPO / "plugins" / "modules" / "xeonsd_rank_status.py",
    REPO / "plugins" / "module_utils" / "xeonsd_joblog.py",
]
NODES = [{"name": f"node{i}", "address": f"10.0.0.{10 + i}"} for i in range(1, 3)]


@pytest.fixture
def wrapper(tmp_path: Path) -> str:
    """The mpi role's wrapper (/etc/xeonsd/run), rendered, with an env.sh whose PATH has this venv's xeonsd."""
    etc = tmp_path / "etc"
    etc.mkdir()
    write_wrapper(etc)
    (etc / "env.sh").write_text(f"export PATH={shlex.quote(str(VENV_BIN))}:$PATH\n")
    return str(etc / "run")


def _run(argv: list[str], stdin: str | None = None) -> dict:
    """A module's command, as module.run_command runs it, and the answer the module returns."""
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=120)
    return joblog.answer(argv, proc.returncode, proc.stdout, proc.stderr)


def test_the_job_module_s_poll_is_the_package_s_answer(tmp_path: Path, wrapper: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    attempts.begin_attempt(run, now=1)
    attempts.write_exit(run, 2, now=61)
    (tmp_path / "async").write_text(json.dumps({"rc": 2}))
    for rank in range(8):
        node = NODES[rank // 4]
        status = RankStatus(
            rank=rank,
            world=8,
            node=node["name"],
            address=node["address"],
            pid=rank,
            state="running",
            step=3,
            updated=1.0,
            attempt=1,
        )
        writer = RankStatusFile(tmp_path / node["name"], status)
        if rank == 5:
            writer.fail("input", "no images found")
    params = {
        "env_wrapper": wrapper,
        "run_dir": str(run),
        "results_file": str(tmp_path / "async"),
        "node_names": [n["name"] for n in NODES],
        "node_addresses": [n["address"] for n in NODES],
        "ranks_per_node": 4,
        "total_steps": 10,
        "excerpt_lines": 5,
    }
    # xeonsd_rank_status on each node, then xeonsd_job with what they found.
    gathered = [
        s for n in NODES for s in _run(joblog.jobstatus_argv(wrapper, "ranks", str(tmp_path / n["name"])))["statuses"]
    ]
    assert len(gathered) == 8
    params_gathered = {**params, "rank_status": gathered}
    state = _run(joblog.poll_argv(params_gathered), joblog.poll_stdin(params_gathered))
    assert state["finished"] and state["exit_code"] == 2 and state["exit"]["ended"] - state["exit"]["started"] == 60
    assert state["failure"]["nodes"] == ["node2"] and state["failure"]["ranks"] == [5]
    assert state["msg"].startswith("finished (rc 2) · starting: 0/8 ranks up")
    # Without the gathered files: this node's own (none here), and a node where no rank started has none.
    assert _run(joblog.poll_argv(params))["failure"]["summary"].startswith("unknown node: no rank of this attempt")
    assert _run(joblog.jobstatus_argv(wrapper, "ranks", str(tmp_path / "node9")))["statuses"] == []


def test_a_poll_that_cannot_read_the_job_says_why(tmp_path: Path, wrapper: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "exit.json").write_text(json.dumps({"rc": 2, "started": 1, "ended": 61}))
    (tmp_path / "async").write_text(json.dumps({"rc": 2}))
    params = {
        "env_wrapper": wrapper,
        "run_dir": str(run),
        "results_file": str(tmp_path / "async"),
        "node_names": [],
        "node_addresses": [],
        "ranks_per_node": 1,
        "total_steps": 10,
        "excerpt_lines": 5,
    }
    with pytest.raises(ValueError, match="schema None, this role reads schema 1"):
        _run(joblog.poll_argv(params))
    # A node whose diffuser env lacks the command: the wrapper's own exit code and words, not a traceback.
    argv = joblog.poll_argv(params)
    argv[1] = "xeonsd-not-installed"
    with pytest.raises(ValueError, match=r"failed \(rc 91\): no xeonsd-not-installed on PATH"):
        _run(argv)


# ---- one definition: the schema and the exit codes are the package's alone --------------------------------------


def test_the_lock_conflict_code_comes_from_the_package() -> None:
    """launch.yml's flock and wait.yml's "nothing to diagnose" read xeonsd's one definition, through the fact the
    role fills from `xeonsd jobstatus codes`; no task of the role writes the number."""
    out = subprocess.run(
        [sys.executable, "-m", "xeonsd.cli", "jobstatus", "codes"], capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == jobstatus.EXIT_CODES and jobstatus.EXIT_CODES["lock_conflict"] == 75
    launch = (ROLE / "tasks" / "launch.yml").read_text()
    assert 'argv: ["{{ finetune_env_wrapper }}", xeonsd, jobstatus, codes]' in launch
    assert '--conflict-exit-code, "{{ finetune_exit_codes.lock_conflict }}"' in launch
    assert (ROLE / "tasks" / "wait.yml").read_text().count("[0, finetune_exit_codes.lock_conflict]") == 2
    code = str(jobstatus.LOCK_CONFLICT_RC)
    for path in [
        *ROLE.glob("tasks/*.yml"),
        *ROLE.glob("templates/*"),
        *JOB_CODE,
    ]:
        assert not re.search(rf"(?<![\w.]){code}(?![\w.])", path.read_text()), f"{path}: a second {code}"


def test_the_role_s_python_restates_no_part_of_the_schema() -> None:
    """The modules only run `xeonsd jobstatus` and return its JSON: no schema version, state, error kind or file
    name of job_status's may appear in them again."""
    words = [
        "SCHEMA_VERSION",
        "LOCK_CONFLICT",
        *jobstatus.STATES,
        *jobstatus.ERROR_KINDS,
        jobstatus.EXIT_FILE,
        jobstatus.ATTEMPT_FILE,
        jobstatus.LOG_FILE,
        "rank-",
    ]
    for path in JOB_CODE:
        code = "\n".join(ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith(("#", '"""')))
        found = [w for w in words if re.search(rf"['\"]{re.escape(w)}|\b{re.escape(w)}\b(?=\s*=)", code)]
        assert not found, f"{path.name} restates {found}"


def test_the_job_logic_imports_without_ansible() -> None:
    """The tests run it in the pytest process; it must not load Ansible there (see the import above)."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import xeonsd_joblog; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'ansible'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(Path(joblog.__file__).parent)], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
