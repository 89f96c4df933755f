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


def test_make_dataset_pairs_writes_each_image_with_its_reference_and_the_instruction(tmp_path: Path, cli_env) -> None:
    """``--pairs``: what edit training reads (metadata.jsonl's cond_image), at any --size; what it cannot honour is
    refused naming the flags, and nothing is written."""
    import json

    import numpy as np
    from PIL import Image

    out = tmp_path / "pairs"
    done = run_cli(["make-dataset", str(out), "--pairs", "--count", "3", "--size", "96"], cli_env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(out / f"p{i}.png") for i in range(3)]
    rows = [json.loads(line) for line in (out / "metadata.jsonl").read_text().splitlines()]
    assert rows == [{"file_name": f"p{i}.png", "text": "turn the red square blue", "cond_image": f"ref/p{i}.png"}
                    for i in range(3)]  # fmt: skip
    for i in range(3):
        image, ref = (np.asarray(Image.open(out / d / f"p{i}.png")) for d in (".", "ref"))
        assert image.shape == ref.shape == (96, 96, 3)
        changed = (image != ref).any(axis=2)
        # one square, blue in the image and red in its reference, and nothing else differs
        assert (
            changed.sum() == 36 * 36
            and (image[changed] == (30, 30, 230)).all()
            and (ref[changed] == (230, 30, 30)).all()
        )
    refused = run_cli(["make-dataset", str(tmp_path / "no"), "--pairs", "--captions", "txt"], cli_env)
    assert refused.returncode == 2 and "leave out --captions and --sizes" in refused.stderr
    assert not (tmp_path / "no").exists()


def test_make_tiny_model_offers_every_arch_the_builders_know() -> None:
    # The CLI reads the --arch choices from the family folders only when make-tiny-model runs (building its parser
    # must not import the builders): they are the registry's.
    import dataclasses

    from xeonsd.assets.models import arch_names
    from xeonsd.cli import TinyModelArgs

    arch = next(f for f in dataclasses.fields(TinyModelArgs) if f.name == "arch")
    assert sorted(arch.metadata["argparse"]["choices"]) == sorted(arch_names())
