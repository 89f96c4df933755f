"""report.html shows what a run directory holds and names what it lacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from PIL import Image

from xeonsd.jobs import attempts
from xeonsd.ops.report import training_summary


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run-1"
    (run / "images").mkdir(parents=True)
    rows = [
        {
            "step": s,
            "loss": 1.0 / s,
            "s_per_step": 2.0 + s % 2,
            "images_per_s": 8.0,
            "ranks": 16,
            "backend": "gloo",
            "allreduce_bytes": 3076,
        }
        for s in range(1, 6)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    Image.new("RGB", (8, 8)).save(run / "loss.png")
    for i in range(5):
        Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(run / "images" / f"image_{i:03d}.png")
    (run / "images" / "timings.json").write_text(json.dumps({"load_s": 1.5, "compile_s": 2.5, "images_per_s": 0.7}))
    (run / "run.json").write_text(
        json.dumps(
            {
                "command": "mpirun -f /etc/xeonsd/nodefile -n 16 -ppn 4 xeonsd train --placeholder_token <dicoo>",
                "versions": {"torch": "2.13.0", "diffusers": "0.39.0"},
                "phases": {"train_s": 312.0},
            }
        )
    )
    (run / "train_summary.json").write_text(
        json.dumps(
            {
                "method": "textual_inversion",
                "trainable_params": 768,
                "placeholder_tokens": ["<dicoo>"],
                "base_model": "/m/sd15",
                "base_model_fingerprint": "0123456789abcdef",
                "allreduce_bytes_per_step": 3076,
                "prompts": {"source": "templates", "count": 27, "per_image": False},
                "result": {"path": "learned_embeds.safetensors", "bytes": 3200},
            }
        )
    )
    return run


def test_report_shows_a_lora_runs_method_adapter_captions_all_reduce_and_the_reused_base_export(tmp_path):
    """A LoRA run: the method, trainable parameters, the adapter's size, the captions used, the bytes all-reduced
    per step (counted and measured), the family with its resolution and a flow model's σ sampling, and the base
    model's export, reused, found through the run's openvino link."""
    from xeonsd.ops.report import build_report

    run = _run_dir(tmp_path)
    (run / "train_summary.json").write_text(
        json.dumps(
            {
                "method": "lora",
                "trainable_params": 797184,
                "adapter": "dora",
                "lora_rank": 4,
                "lora_alpha": 4,
                "base_model": "/m/sd15",
                "base_model_fingerprint": "0123456789abcdef",
                "allreduce_bytes_per_step": 3188740,
                "prompts": {"source": "metadata.jsonl", "count": 5, "per_image": True},
                "result": {"path": "pytorch_lora_weights.safetensors", "bytes": 3228672},
                "family": "flux",
                "resolution": 1024,
                "loss": {"weighting_scheme": "logit_normal", "logit_mean": 0.0, "logit_std": 1.0},
            }
        )
    )
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows[0]["allreduce_bytes_measured"] = 3200000
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = tmp_path / "openvino-base" / "0123456789abcdef-5x1-128x128-fp32"
    base.mkdir(parents=True)
    (base / "xeonsd_export.json").write_text(json.dumps({"format": "xeonsd-openvino-export/1", "source": "/m/sd15"}))
    (run / "openvino").symlink_to(base)
    info = json.loads((run / "run.json").read_text())
    info["export"] = {"dir": str(base), "of": "the base model (shared by its runs)", "reused": True}
    (run / "run.json").write_text(json.dumps(info))
    page = build_report(run)
    for text in (
        "<h2>Method</h2>",
        "<td>lora</td>",
        "<td>797,184</td>",
        "<th>adapter type</th><td>dora</td>",
        "<th>LoRA adapter</th>",
        "pytorch_lora_weights.safetensors · 3.2 MB",
        "5 captions from metadata.jsonl",
        "3.2 MB (measured 3.2 MB)",
        "fingerprint 0123456789abcdef",
        "<h2>OpenVINO export</h2>",
        "reused (made by an earlier run)",
        "xeonsd-openvino-export/1",
        "<td>FLUX.1, 1024 px</td>",
        "<th>σ sampling (flow matching)</th><td>logit_normal (mean 0.0, std 1.0)</td>",
    ):
        assert text in page, text
    assert "Not in this run directory" not in page


def test_report_says_a_run_trained_on_image_pairs_and_from_which_field(tmp_path):
    """train_summary.json's cond_image_column (edit training): the Method table names the references per image
    (sample_references) and the metadata.jsonl field; a text-to-image run has no such row."""
    from xeonsd.ops.report import build_report

    run = _run_dir(tmp_path)
    assert "reference image(s) per image" not in build_report(run)
    summary = json.loads((run / "train_summary.json").read_text())
    summary |= {"cond_image_column": "cond_image", "sample_references": ["/data/ref/p0.png"]}
    (run / "train_summary.json").write_text(json.dumps(summary))
    assert (
        "<th>edit training on image pairs</th><td>1 reference image(s) per image (the metadata.jsonl field "
        "cond_image)</td>"
    ) in build_report(run)


def test_training_summary_from_metrics():
    rows = [
        {"step": s, "loss": loss, "s_per_step": t, "images_per_s": 16 / t, "ranks": 16}
        for s, loss, t in ((1, 0.9, 9.0), (2, 0.5, 2.0), (3, 0.4, 4.0))
    ]
    summary = training_summary(rows)
    assert summary["steps"] == 3 and summary["ranks"] == 16
    assert summary["median s/step"] == 3.0  # the first (warm-up) step is left out
    assert summary["first loss"] == 0.9 and summary["last loss"] == 0.4


def test_report_states_the_smoothed_loss_and_its_window(tmp_path, demo_metrics):
    """The raw first and last loss of the demo run are noise; the report gives the EMA's trend and its window."""
    from xeonsd.ops.report import build_report

    summary = training_summary(demo_metrics)
    assert summary["loss EMA, window 5 steps (α=0.33)"] == "1.1211 at step 5 → 1.1341 at step 30"
    run = _run_dir(tmp_path)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in demo_metrics))
    page = build_report(run)
    assert "1.1211 at step 5 → 1.1341 at step 30" in page
    assert "exponential moving average of the loss: EMA, window 5 steps (α=0.33)." in page and 'src="loss.png"' in page


def test_report_links_every_image_and_escapes_the_command(tmp_path, cli_env):
    run = _run_dir(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "xeonsd.cli", "report", str(run)],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
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
    proc = subprocess.run(
        [sys.executable, "-m", "xeonsd.cli", "report", str(run)],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0
    page = (run / "report.html").read_text()
    assert "metrics.jsonl" in page and "images/*.png" in page and "run.json" in page and "train_summary.json" in page
    proc = subprocess.run(
        [sys.executable, "-m", "xeonsd.cli", "report", str(tmp_path / "nope")],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_report_shows_the_job_script_and_the_stack_when_run_json_is_absent(tmp_path, cli_env):
    run = tmp_path / "playbook-run"
    run.mkdir()
    (run / "run.sh").write_text(
        "mpirun -l -f /etc/xeonsd/nodefile -n 16 -ppn 4 xeonsd train --placeholder_token='<dicoo>'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "xeonsd.cli", "report", str(run)],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    page = (run / "report.html").read_text()
    assert "-n 16 -ppn 4 xeonsd train" in page and "&lt;dicoo&gt;" in page
    import torch

    assert f"<th>torch</th><td>{torch.__version__}</td>" in page


def _stats_run(tmp_path: Path, prices: dict | None, slow_node: int | None = 3) -> Path:
    """A run directory whose metrics carry the gathered rank statistics (4 nodes × 4 ranks, every 5 of 20 steps)."""
    from xeonsd.cluster.rank_stats import Interval, StragglerWatch, summarize

    run = _run_dir(tmp_path)
    watch, rows = StragglerWatch(), []
    for step in range(1, 21):
        row = {"step": step, "loss": 1.0 / step, "s_per_step": 3.6, "images_per_s": 4.4, "ranks": 16, "backend": "gloo"}
        if step % 5 == 0:
            ivs = []
            for r in range(16):
                compute, allreduce, util = (3.0, 0.1, 0.55) if r // 4 + 1 == slow_node else (2.0, 1.1, 0.95)
                wall = 5 * (compute + allreduce + 0.5)
                ivs.append(Interval(5, wall, util * wall * 4, 4, 2.5, 5 * allreduce))
            summary = summarize(ivs, [f"node{r // 4 + 1}" for r in range(16)])
            thresholds = {"cpu_util": 0.8, "compute_ratio": 1.3, "intervals": 3}
            row |= {"rank_stats": {**summary, "thresholds": thresholds}, "stragglers": watch.judge(summary)}
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    info = json.loads((run / "run.json").read_text())
    info["phases"] = {"training job, wall (s)": 90.0}
    if prices is not None:
        info["cost"] = prices
    (run / "run.json").write_text(json.dumps(info))
    return run


def test_report_shows_cpu_use_time_split_straggler_and_cost_and_run_json_gets_the_figures(tmp_path, cli_env):
    prices = {"node_hour_price": 2.0, "currency": "EUR", "gpu_hour_price": 12.0, "gpu_s_per_step": 1.2}
    run = _stats_run(tmp_path, prices)
    proc = subprocess.run(
        [sys.executable, "-m", "xeonsd.cli", "report", str(run)], env=cli_env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    page = (run / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 2  # the CPU use over the run and the split bars
    assert "<h2>CPU use per node</h2>" in page and "mean 55 %, lowest 55 % (ranks 8, 9, 10, 11)" in page
    assert "compute 3.000 s · all-reduce 0.100 s · data 0.500 s" in page
    assert "<b>node3</b> (ranks 8, 9, 10, 11), from step 5" in page and "1.50× the median" in page
    assert page.index("threads per rank vs. physical cores") < page.index("another process on the node")
    figs = json.loads((run / "run.json").read_text())["cluster_figures"]
    cost = figs["cost"]
    # 4 nodes × 90 s = 0.1 node-hours × 2 EUR; 100 steps at the median 3.6 s on 4 nodes = 0.4 node-hours.
    assert cost["node_hours"] == 0.1 and cost["training_cost"] == 0.2 and cost["cost_per_100_steps"] == 0.8
    assert cost["cost_per_generated_image"] == round(2.0 / 0.7 / 3600, 6)  # one node, 1 / 0.7 images/s
    # The GPU: 12 EUR/h against 4 × 2 EUR/h = 1.5× the price; 100 steps at 1.2 s = 0.4 EUR, half the cluster's.
    assert cost["gpu"]["price_ratio_gpu_to_cluster"] == 1.5 and cost["gpu"]["cost_ratio_gpu_to_cluster"] == 0.5
    assert "<h2>Cost</h2>" in page and "0.8 EUR (median 3.6 s/step)" in page and "Against a GPU" in page
    assert [s["node"] for s in figs["stragglers"]] == ["node3"] and figs["cpu_util"]["node1"]["mean"] == 0.95
    assert figs["time_split_s_per_step"]["node3"] == {"compute_s": 3.0, "allreduce_s": 0.1, "data_s": 0.5}


def test_report_without_a_price_or_a_straggler_says_so_and_shows_no_cost(tmp_path, cli_env):
    run = _stats_run(tmp_path, None, slow_node=None)
    proc = subprocess.run(
        [sys.executable, "-m", "xeonsd.cli", "report", str(run)], env=cli_env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    page = (run / "report.html").read_text()
    assert "No straggler (every node at or above 80 % CPU and within 1.3× the median compute time)." in page
    assert "<h2>Cost</h2>" not in page
    assert json.loads((run / "run.json").read_text())["cluster_figures"]["cost"] == {}


def _rendered(run: Path, cli_env) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "xeonsd.cli", "report", str(run)], env=cli_env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return (run / "report.html").read_text()


def test_report_opens_with_the_status_and_the_images_and_folds_how_it_ran_last(tmp_path, cli_env):
    """The order a reader asks in: did it work (status), what it made (images, the validation grid), the loss, the
    cluster; the command, the versions and the job script last, folded. Every image it links is in the directory."""
    import re

    prices = {"node_hour_price": 2.0, "currency": "EUR"}
    run = _stats_run(tmp_path, prices)
    Image.new("RGB", (8, 8)).save(run / "validation_grid.png")
    timings = {"images_per_s": 0.7, "prompts": ["a yellow <dicoo> robot at the beach"] * 5}
    (run / "images" / "timings.json").write_text(json.dumps(timings))
    (run / "run.sh").write_text("mpiexec.hydra -n 16 -ppn 4 xeonsd train --placeholder_token='<dicoo>'\n")
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "cluster": {"nodes": "node1, node2, node3, node4"}}))
    page = _rendered(run, cli_env)
    headings = re.findall(r"<h2>(.*?)</h2>", page)
    assert headings == [
        "Generated images",
        "Validation images",
        "Loss",
        "Method",
        "Cluster",
        "CPU use per node",
        "Where the step time goes",
        "Stragglers",
        "Cost",
        "Throughput per phase",
        "How it ran",
    ], headings
    status = page[page.index("<p class='status") : page.index("<h2>Generated images</h2>")]
    assert (
        "<b class=state>Done</b> · 20 steps · 1 min 30 s training wall time · 4.4 images/s in training · cost 0.2 EUR"
        in status
    )
    assert "<p>Prompt: <q>a yellow &lt;dicoo&gt; robot at the beach</q></p>" in page  # not a Python list
    folded = page[page.index("<h2>How it ran</h2>") :]
    summaries = re.findall(r"<details><summary>(.*?)</summary>", folded)
    assert summaries == ["Command", "Versions", "Job script (run.sh)"]
    assert "mpiexec.hydra -n 16 -ppn 4" in folded and "2.13.0" in folded and "mpiexec.hydra" not in page[: -len(folded)]
    sources = [s for s in re.findall(r'src="([^"]+)"', page) if not s.startswith("data:")]
    assert sources[:5] == [f"images/image_{i:03d}.png" for i in range(5)]
    assert sources[5:] == ["validation_grid.png", "loss.png"]
    assert all((run / s).is_file() for s in sources), [s for s in sources if not (run / s).is_file()]
    assert 'name=viewport content="width=device-width' in page  # readable on a phone


def test_the_status_line_says_a_failed_run_with_its_exit_code(tmp_path, cli_env):
    run = _run_dir(tmp_path)
    attempts.begin_attempt(run, now=1, time_limit_s=60)
    attempts.write_exit(run, rc=1, now=80)
    page = _rendered(run, cli_env)
    assert "<p class='status failed'><b class=state>Failed (exit code 1)</b> · 5 steps · " in page
    assert "cost: no node_hour_price set" in page


def test_the_report_says_once_that_every_node_is_low_on_cpu_and_names_no_straggler(tmp_path, cli_env):
    from xeonsd.cluster.rank_stats import Interval, StragglerWatch, summarize

    run = _run_dir(tmp_path)
    watch, rows = StragglerWatch(shared_cores=2), []
    for step in range(1, 21):
        row = {"step": step, "loss": 1.0 / step, "s_per_step": 3.6, "images_per_s": 4.4, "ranks": 16, "backend": "gloo"}
        if step % 5 == 0:
            ivs = [Interval(5, 18.0, 0.11 * 18.0, 1, 2.5, 5.0, cores=2) for _ in range(16)]
            summary = summarize(ivs, [f"node{r // 4 + 1}" for r in range(16)])
            row |= {"rank_stats": {**summary, "thresholds": {}}, **watch.verdict(summary)}
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = _rendered(run, cli_env)
    stragglers = page[page.index("<h2>Stragglers</h2>") :]
    assert "<b>Low CPU on every node</b> (from step 15): all 4 nodes equally low on CPU (11%" in stragglers
    assert "16 threads on 2 cores" in stragglers and "No node lags the others." in stragglers
    assert "<ul class=stragglers>" not in page
    verdict = json.loads((run / "run.json").read_text())["cluster_figures"]["layout_verdict"]
    assert verdict["shared_cores"] == 2 and verdict["first_step"] == 15
