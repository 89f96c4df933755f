"""The quiet console of ``xeonsd make-tiny-model`` and ``make-dataset`` (the demo and the tests run them): the
output's path(s) and our own log line on the console, the libraries' chatter (optimum's distributions notice,
transformers' torchvision fallbacks, the "Writing model shards" bars) in the log beside the output, as export's and
generate's (xeonsd.console)."""

from __future__ import annotations

from pathlib import Path

from cli_runs import run_cli

from xeonsd.console import log_path_beside

CHATTER = (
    "Multiple distributions found",
    "requires torchvision",
    "CLIPImageProcessor",
    "SiglipImageProcessor",
    "Writing model shards",
    "it/s]",
    "Warning",
    "warn(",
)


def _chatter(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(c in line for c in CHATTER)]


def test_make_tiny_model_prints_its_path_and_our_line_only(tmp_path: Path, cli_env) -> None:
    out = tmp_path / "tiny"
    done = run_cli(["make-tiny-model", str(out)], cli_env)
    assert done.returncode == 0, done.stderr
    assert _chatter(done.stdout + done.stderr) == [], done.stdout + done.stderr
    assert done.stdout == f"{out}\n"
    assert "wrote tiny pipeline to" in done.stderr  # our own log line stays
    assert (out / "model_index.json").is_file()
    assert "Writing model shards" in log_path_beside(out).read_text()  # the chatter went to the log


def test_make_dataset_prints_its_images_only(tmp_path: Path, cli_env) -> None:
    out = tmp_path / "dicoo"
    done = run_cli(["make-dataset", str(out), "--count", "2", "--captions", "metadata"], cli_env)
    assert done.returncode == 0, done.stderr
    assert _chatter(done.stdout + done.stderr) == [], done.stdout + done.stderr
    assert done.stdout.splitlines() == [str(out / "dicoo_00.png"), str(out / "dicoo_01.png")]
    assert "wrote 2 square images" in done.stderr


def test_make_tiny_model_offers_every_arch_the_builders_know() -> None:
    # The CLI reads the --arch choices from the family folders only when make-tiny-model runs (building its parser
    # must not import the builders): they are the registry's.
    import dataclasses

    from xeonsd.assets.models import arch_names
    from xeonsd.cli import TinyModelArgs

    arch = next(f for f in dataclasses.fields(TinyModelArgs) if f.name == "arch")
    assert sorted(arch.metadata["argparse"]["choices"]) == sorted(arch_names())
