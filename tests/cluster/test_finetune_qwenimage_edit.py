"""finetune.yml with a Qwen-Image-Edit-2511 base model on image pairs, on the real 4-node test cluster: the pairs'
reference images staged in their subfolder by the dataset role (tests/cluster/stage_dataset.yml; dataset_recurse,
on for pairs), a LoRA trained over
the ranks, and, because optimum-intel has no OpenVINO export for the family, no export: export.yml makes the images
with `xeonsd generate --engine torch` from the base model, the LoRA and the run's sample reference, and the report
is written."""

from __future__ import annotations

import json

from assets import PAIRS_PROMPT, make_pairs
from harness import Cluster
from jobs import RUNS, finetune_other_base
from runner import run_playbook

RUN = "qwen-edit-lora"


def test_a_qwen_image_edit_lora_on_pairs_runs_through_to_images_made_by_pytorch(provisioned: Cluster) -> None:
    from assets import _make_tiny

    tiny = _make_tiny(provisioned.assets_dir, "tiny-qwenimage-edit")
    pairs = make_pairs(provisioned.assets_dir)
    data = ("-e", "dataset_dir=/home/devcloud/pairs", "-e", "finetune_cond_image_column=cond_image")
    staged = run_playbook(
        "tests/cluster/stage_dataset.yml",
        provisioned.inventory,
        *("-e", f"dataset_source_dir={pairs}", *data),
        state_dir=provisioned.state_dir,
        name="stage-pairs",
        timeout=600,
    )
    assert staged.rc == 0, staged.tail(60)
    for node in ("node1", "node4"):  # the references' subfolder too (dataset_recurse), readable by the job's user
        readable = "su -s /bin/sh devcloud -c 'test -r /home/devcloud/pairs/ref/p4.png'"
        assert provisioned.ssh(node, readable, check=False).returncode == 0, node
    result, run = finetune_other_base(
        provisioned,
        "xeonsd/tiny-qwenimage-edit",
        tiny,
        RUN,
        2,
        *data,
        *("-e", "finetune_resolution=64", "-e", f"openvino_export_prompt={PAIRS_PROMPT}"),
    )
    summary = json.loads((run / "train_summary.json").read_text())
    assert (summary["family"], summary["resolution"], summary["ranks"]) == ("qwenimage_edit", 64, 4), summary
    (reference,) = summary["sample_references"]
    assert reference.endswith("/pairs/ref/p0.png"), summary
    assert "optimum-intel has none for Qwen-Image-Edit-2511" in result.output
    timings = json.loads((run / "images" / "timings.json").read_text())
    assert (timings["engine"], timings["num_images"], timings["shape"]["height"]) == ("torch", 5, 64), timings
    assert len(list((run / "images").glob("image_*.png"))) == 5
    assert not (run / "openvino").exists()
    none = provisioned.ssh("node1", f"test ! -e {RUNS}/{RUN}/openvino")
    assert none.returncode == 0, "no export for the family: the run has no openvino/"
    report = (run / "report.html").read_text()
    assert "<h2>OpenVINO export</h2>" not in report and "image_000.png" in report
    print(
        f"\nfinetune.yml Qwen-Image-Edit lora on pairs (tiny, 2 steps, 4 ranks, torch images): "
        f"{result.seconds:.1f} s wall (staging not counted)"
    )
