"""The quiet console of ``xeonsd train``: our own lines (start-up, steps, the result, errors) on the console, the
libraries' chatter in libraries.log in the output directory (on the console too with ``-v``)."""

from __future__ import annotations

from pathlib import Path

from cli_runs import run_cli, train_args

# What the libraries print on every tiny run (transformers' loading bar, optimum's notice where two distributions
# are installed) and what no console line of ours contains.
CHATTER = ("Loading weights",)
ALSO_NOT = ("Multiple distributions found", "it/s]", "deprecated", "FutureWarning", "UserWarning")


def test_train_shows_our_lines_and_keeps_the_chatter_in_the_log(tiny_model: Path, dataset: Path, tmp_path, cli_env):
    out = tmp_path / "out"
    proc = run_cli(["train", *train_args(tiny_model, dataset, out, steps=2)], cli_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = (proc.stdout + proc.stderr).splitlines()
    assert [line for line in console if any(c in line for c in CHATTER + ALSO_NOT)] == []
    assert proc.stdout.startswith("done: 2 steps on 1 rank(s)")  # the result line, on stdout
    assert "INFO xeonsd.train: step 2/2 loss " in proc.stderr and "start-up: models loaded" in proc.stderr
    log = (out / "libraries.log").read_text()
    assert all(c in log for c in CHATTER), log[-3000:]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".libraries.log")]  # no temporary left


def test_train_verbose_shows_the_chatter_and_an_error_still_reaches_the_console(
    tiny_model: Path, dataset: Path, tmp_path, cli_env
):
    # A refused run: the error on the console, no output directory and so no log (nothing half-written).
    bad = run_cli(["train", *train_args(tiny_model, tmp_path / "no-images", tmp_path / "bad", steps=1)], cli_env)
    assert bad.returncode == 2 and "xeonsd train: error: " in bad.stderr, bad.stderr[-2000:]
    assert not (tmp_path / "bad").exists()
    out = tmp_path / "v"
    loud = run_cli(
        ["train", "-v", *train_args(tiny_model, dataset, out, steps=1), f"--log={tmp_path / 'v.log'}"], cli_env
    )
    assert loud.returncode == 0, loud.stderr[-3000:]
    assert all(c in loud.stderr for c in CHATTER), loud.stderr[-3000:]
    assert all(c in (tmp_path / "v.log").read_text() for c in CHATTER)
    assert not (out / "libraries.log").exists()
