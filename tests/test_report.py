"""report.html shows what a run directory holds and names what it lacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from PIL import Image

from xeonsd.report import training_summary


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run-1"
    (run / "images").mkdir(parents=True)
    rows = [{"step": s, "loss": 1.0 / s, "s_per_step": 2.0 + s % 2, "images_per_s": 8.0, "ranks": 16,
             "backend": "gloo", "allreduce_bytes": 3076} for s in range(1, 6)]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    Image.new("RGB", (8, 8)).save(run / "loss.png")
    for i in range(5):
        Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(run / "images" / f"image_{i:03d}.png")
    (run / "images" / "timings.json").write_text(json.dumps({"load_s": 1.5, "compile_s": 2.5, "images_per_s": 0.7}))
    (run / "run.json").write_text(json.dumps({
        "command": "mpirun -f /etc/xeonsd/nodefile -n 16 -ppn 4 xeonsd train --placeholder_token <dicoo>",
        "versions": {"torch": "2.13.0", "diffusers": "0.39.0"}, "phases": {"train_s": 312.0},
    }))  # fmt: skip
    return run


def test_training_summary_from_metrics():
    rows = [{"step": s, "loss": loss, "s_per_step": t, "images_per_s": 16 / t, "ranks": 16}
            for s, loss, t in ((1, 0.9, 9.0), (2, 0.5, 2.0), (3, 0.4, 4.0))]  # fmt: skip
    summary = training_summary(rows)
    assert summary["steps"] == 3 and summary["ranks"] == 16
    assert summary["median s/step"] == 3.0  # the first (warm-up) step is left out
    assert summary["first loss"] == 0.9 and summary["last loss"] == 0.4


def test_report_states_the_smoothed_loss_and_its_window(tmp_path, demo_metrics):
    """The raw first and last loss of the demo run are noise; the report gives the EMA's trend and its window."""
    from xeonsd.report import build_report

    summary = training_summary(demo_metrics)
    assert summary["loss EMA, window 5 steps (α=0.33)"] == "1.1211 at step 5 → 1.1341 at step 30"
    run = _run_dir(tmp_path)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in demo_metrics))
    page = build_report(run)
    assert "1.1211 at step 5 → 1.1341 at step 30" in page
    assert "exponential moving average of the loss: EMA, window 5 steps (α=0.33)." in page and 'src="loss.png"' in page


def test_report_links_every_image_and_escapes_the_command(tmp_path, cli_env):
    run = _run_dir(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "xeonsd.cli", "report", str(run)], env=cli_env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    page = (run / "report.html").read_text()
    assert "&lt;dicoo&gt;" in page and "<dicoo>" not in page
    for i in range(5):
        assert f'src="images/image_{i:03d}.png"' in page
    assert 'src="loss.png"' in page and "2.13.0" in page and "train_s" in page and "compile_s" in page
    assert "Not in this run directory" not in page


def test_report_names_what_is_missing(tmp_path, cli_env):
    run = tmp_path / "empty-run"
    run.mkdir()
    proc = subprocess.run([sys.executable, "-m", "xeonsd.cli", "report", str(run)], env=cli_env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0
    page = (run / "report.html").read_text()
    assert "metrics.jsonl" in page and "images/*.png" in page and "run.json" in page
    proc = subprocess.run([sys.executable, "-m", "xeonsd.cli", "report", str(tmp_path / "nope")], env=cli_env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_report_shows_the_job_script_and_the_stack_when_run_json_is_absent(tmp_path, cli_env):
    run = tmp_path / "playbook-run"
    run.mkdir()
    (run / "run.sh").write_text(
        "mpirun -l -f /etc/xeonsd/nodefile -n 16 -ppn 4 xeonsd train --placeholder_token='<dicoo>'\n"
    )
    proc = subprocess.run([sys.executable, "-m", "xeonsd.cli", "report", str(run)], env=cli_env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    page = (run / "report.html").read_text()
    assert "-n 16 -ppn 4 xeonsd train" in page and "&lt;dicoo&gt;" in page
    import torch

    assert f"<th>torch</th><td>{torch.__version__}</td>" in page
