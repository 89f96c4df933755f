"""finetune.yml with a Qwen-Image-Edit-2511 base model on image pairs, on the real 4-node test cluster: the pairs'
reference images staged in their subfolder by the dataset role (tests/cluster/stage_dataset.yml; dataset_recurse,
on for pairs), identical to the controller's and readable by the job's user on every node; a LoRA trained over the
ranks, the pairs named in train_summary.json, the play's output and the report; and, because optimum-intel has no OpenVINO export for the family, no export: export.yml makes the images
with `xeonsd generate --engine torch` from the base model, the LoRA and the run's sample reference, and the report
is written."""

from __future__ import annotations

import hashlib
import json

from assets import PAIRS_PROMPT, make_pairs
from harness import Cluster
from jobs import RUNS, finetune_other_base, stage_dataset

RUN = "qwen-edit-lora"


def test_a_qwen_image_edit_lora_on_pairs_runs_through_to_images_made_by_pytorch(provisioned: Cluster) -> None:
    from assets import _make_tiny

    tiny = _make_tiny(provisioned.assets_dir, "tiny-qwenimage-edit")
    pairs = make_pairs(provisioned.assets_dir)
    data = ("-e", "dataset_dir=/home/devcloud/pairs", "-e", "finetune_cond_image_column=cond_image")
    stage_dataset(provisioned, "stage-pairs", pairs, *data)
    expected = {f"ref/{p.name}": hashlib.sha1(p.read_bytes()).hexdigest() for p in sorted((pairs / "ref").iterdir())}
    assert len(expected) == 5
    for node in provisioned.nodes:  # every reference (dataset_recurse), as the job's user reads it
        out = provisioned.ssh(node, "su -s /bin/sh devcloud -c 'cd /home/devcloud/pairs && sha1sum ref/*'").stdout
        found = {name: sha for sha, name in (line.split() for line in out.splitlines())}
        assert found == expected, (node, found)
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
    assert summary["cond_image_column"] == "cond_image", summary
    assert "trained at 64 px, on image pairs (the references: metadata.jsonl field cond_image)" in result.output
    assert "optimum-intel has none for Qwen-Image-Edit-2511" in result.output
    timings = json.loads((run / "images" / "timings.json").read_text())
    assert (timings["engine"], timings["num_images"], timings["shape"]["height"]) == ("torch", 5, 64), timings
    assert len(list((run / "images").glob("image_*.png"))) == 5
    assert not (run / "openvino").exists()
    none = provisioned.ssh("node1", f"test ! -e {RUNS}/{RUN}/openvino")
    assert none.returncode == 0, "no export for the family: the run has no openvino/"
    report = (run / "report.html").read_text()
    assert "<h2>OpenVINO export</h2>" not in report and "image_000.png" in report
    assert "1 reference image(s) per image (the metadata.jsonl field cond_image)" in report, report[-3000:]
    print(
        f"\nfinetune.yml Qwen-Image-Edit lora on pairs (tiny, 2 steps, 4 ranks, torch images): "
        f"{result.seconds:.1f} s wall (staging not counted)"
    )
