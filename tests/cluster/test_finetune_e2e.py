"""finetune.yml end to end on the real 4-node test cluster: 16 ranks across 4 nodes train, the result is fetched
and exported to OpenVINO, 5 images and the report are made; the ranks' figures per node and the cost reach the
progress lines, report.html and run.json; a second finetune started while it trains is refused and does not start
a second job. The run is the first of the test_finetune_*.py files (they run in file order on one cluster, see
tests/conftest.py): its base model export is the one test_finetune_methods.py's LoRA run reuses."""

from __future__ import annotations

import json
import re
import time

from harness import Cluster
from jobs import background_playbook, controller_runs, finish, latest_step, wait_for
from runner import TIMINGS, run_playbook


def test_finetune_trains_on_16_ranks_then_exports_generates_and_reports(provisioned: Cluster) -> None:
    """End to end; while it trains, a second finetune is refused and does not start a second job."""
    runs = controller_runs(provisioned)
    with background_playbook(
        provisioned,
        "finetune-e2e",
        "finetune.yml",
        "-e",
        f"controller_runs_dir={runs}",
        "-e",
        "finetune_run_id=e2e",
        "-e",
        "node_hour_price=1.5",
        "-e",
        "price_currency=EUR",
        # 15 steps, not the inventory's 30: three gathers of the ranks' figures (every 5 steps) are what this run
        # checks, and each step of 16 ranks costs over 2 s on 2 cores.
        "-e",
        "finetune_max_train_steps=15",
        "-e",
        "openvino_export_before=true",
    ) as (first, log, began):
        wait_for(lambda: latest_step(provisioned) >= 1, 600, "the first training step", first, log)
        second = run_playbook(
            "finetune.yml",
            provisioned.inventory,
            "-e",
            f"controller_runs_dir={runs}",
            state_dir=provisioned.state_dir,
            name="finetune-refused",
            timeout=300,
        )
        assert second.rc != 0, second.tail()
        assert "A finetune is already running on node1 (run e2e" in second.output, second.tail()
        assert first.poll() is None, "the refused finetune must not disturb the running one"
        rc = finish(first, timeout=1800)
        wall = time.monotonic() - began
    output = log.read_text()
    assert rc == 0, output[-6000:]
    TIMINGS.append(("finetune.yml end to end (train 16 ranks, export, 5 images, report)", wall))

    run = runs / "e2e"
    # Progress was printed on the polls: step/total, loss, s/step; no FAILED line for a poll that only waited.
    assert "node1: step " in output and " s/step" in output and "16 ranks (gloo)" in output
    assert "FAILED - RETRYING" not in output
    # The 4 nodes share this machine's cores: when they are all low on CPU, the play says so once, naming the shared
    # cores, and calls no node a straggler for its CPU use alone.
    if "Low CPU on every node: " in output:
        assert output.count("Low CPU on every node: ") == 1 and "share one machine's" in output
        stragglers = [line for line in output.splitlines() if "Straggler: " in line]
        assert all("× the median" in line and "CPU utilisation" not in line for line in stragglers), stragglers
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 15 and {r["ranks"] for r in rows} == {16} and {r["backend"] for r in rows} == {"gloo"}
    train_log = (run / "train.log").read_text()
    for i in range(1, 5):
        assert f"node={provisioned.address(i)} " in train_log, f"no rank ran on node{i}"
    assert "-n 16 -ppn 4" in (run / "run.sh").read_text()
    assert (run / "loss.png").stat().st_size > 0
    images = sorted(p.name for p in (run / "images").glob("image_*.png"))
    assert len(images) == 5 and (run / "images" / "grid.png").exists()
    timings = json.loads((run / "images" / "timings.json").read_text())
    phases = json.loads((run / "run.json").read_text())["phases"]
    page = (run / "report.html").read_text()
    assert "-n 16 -ppn 4" in page and 'src="loss.png"' in page and 'src="images/image_004.png"' in page
    assert "Not in this run directory" not in page
    # The base model's before row at the same seed, measured with the after row against the training images, opens
    # the report; the model card beside it shows both and loads the embedding.
    assert len(list((run / "images" / "before").glob("image_*.png"))) == 5
    assert page.index("<h2>Before and after</h2>") < page.index("<h2>Loss</h2>")
    assert re.search(r"before 0\.\d{3}, after 0\.\d{3}", page) and "a yellow toy robot" in page
    card = (run / "README.md").read_text()
    assert 'instance_prompt: "<dicoo>"' in card and 'token="<dicoo>"' in card and (run / "before_after.png").is_file()

    # Every rank measured itself; rank 0 gathered them every 5 steps, by node name, into metrics.jsonl, the progress
    # lines, report.html (CPU use per node, the time split, the verdict, the cost at 1.5 EUR/node-hour) and run.json.
    stats = [r["rank_stats"] for r in rows if "rank_stats" in r]
    assert [r["step"] for r in rows if "rank_stats" in r] == [5, 10, 15]
    assert all(len(s["ranks"]) == 16 for s in stats)
    assert [n["node"] for n in stats[-1]["nodes"]] == ["node1", "node2", "node3", "node4"]
    assert " · cpu " in output and "% (lowest node" in output and " vs median " in output
    for section in (
        "<h2>CPU use per node</h2>",
        "<h2>Where the step time goes</h2>",
        "<h2>Stragglers</h2>",
        "<h2>Cost</h2>",
        " EUR",
    ):
        assert section in page, section
    # The node totals of the ranks' memory (the sum of their PSS: a page the node's ranks share counted once).
    memory = page[page.index("<h2>Memory per node</h2>") :]
    for node in ("node1", "node2", "node3", "node4"):
        assert re.search(rf"<th>{node}</th><td>PSS after loading [0-9.]+ GB [^<]* 4 rank\(s\)", memory), node
    figures = json.loads((run / "run.json").read_text())["cluster_figures"]
    assert set(figures["cpu_util"]) == {"node1", "node2", "node3", "node4"}
    assert figures["cost"]["currency"] == "EUR" and figures["cost"]["training_cost"] > 0
    print(
        "\nCPU utilisation per node (mean, lowest):",
        {n: (d["mean"], d["lowest"]) for n, d in figures["cpu_util"].items()},
        "\ntime split per node (s/step):",
        figures["time_split_s_per_step"],
        "\ncost:",
        figures["cost"],
    )

    # The fetched embedding loads into the base pipeline and the token gets the learned vector.
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import load_file

    learned = load_file(run / "learned_embeds.safetensors")
    pipe = StableDiffusionPipeline.from_pretrained(provisioned.assets_dir / "tiny-sd", safety_checker=None)
    pipe.load_textual_inversion(run / "learned_embeds.safetensors")
    token_id = pipe.tokenizer.convert_tokens_to_ids("<dicoo>")
    assert (
        pipe.text_encoder.get_input_embeddings().weight[token_id] - learned["<dicoo>"].reshape(-1)
    ).abs().max() < 1e-6

    # What trained, on the staged captions, and the base model's export made by this run (kept for the next runs).
    for text in (
        "<h2>Method</h2>",
        "<td>textual_inversion</td>",
        "5 captions from metadata.jsonl",
        "<th>learned embedding</th>",
        "<h2>OpenVINO export</h2>",
        "made by this run",
    ):
        assert text in page, text
    export = json.loads((run / "run.json").read_text())["export"]
    assert export["reused"] is False and export["dir"].startswith("/home/devcloud/openvino-base/"), export

    print(
        f"\nfinetune.yml end to end: {wall:.1f} s wall; phases {phases}; "
        f"generate: load {timings.get('load_s')} s, compile {timings.get('compile_s')} s, "
        f"{timings.get('images_per_s')} images/s"
    )
