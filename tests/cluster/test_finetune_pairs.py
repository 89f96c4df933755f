"""finetune.yml with edit training on image pairs and a FLUX.2 [klein] base model, on the real 4-node test cluster:
the pairs (each training image's reference image in ref/, named in metadata.jsonl) staged by the dataset role with
their references on every node, identical to the controller's and readable by the job's user; a LoRA trained on them
over 4 ranks (tiny-flux2, staged as another base model, -e finetune_cond_image_column=cond_image); and, klein having
an OpenVINO export, export.yml exporting it and generating from the run's sample reference."""

from __future__ import annotations

import hashlib
import json

from assets import make_pairs
from harness import Cluster
from jobs import RUNS, finetune_other_base
from runner import run_playbook

RUN = "klein-pairs"
PAIRS_DIR = "/home/devcloud/pairs"  # as test_finetune_qwenimage_edit.py stages them: the second staging changes nothing


def test_a_klein_lora_trains_on_image_pairs_whose_references_the_dataset_role_staged(provisioned: Cluster) -> None:
    """The dataset role stages ref/ with the training images (dataset_expected_count: the 5 at the top level) and
    every node's references match the controller's; finetune.yml trains a FLUX.2 [klein] LoRA on the pairs (family
    flux2, 4 ranks, the pairs in train_summary.json, the play's output and the report) and export.yml exports it and
    generates from the sample reference."""
    from assets import _make_tiny

    pairs = make_pairs(provisioned.assets_dir)
    data = ("-e", f"dataset_dir={PAIRS_DIR}", "-e", "finetune_cond_image_column=cond_image")
    staged = run_playbook(
        "tests/cluster/stage_dataset.yml",
        provisioned.inventory,
        *("-e", f"dataset_source_dir={pairs}", *data),
        state_dir=provisioned.state_dir,
        name="stage-pairs",
        timeout=600,
    )
    assert staged.rc == 0, staged.tail(60)
    expected = {f"ref/{p.name}": hashlib.sha1(p.read_bytes()).hexdigest() for p in sorted((pairs / "ref").iterdir())}
    assert len(expected) == 5
    for node in provisioned.nodes:  # every reference, as the job's user reads it
        out = provisioned.ssh(node, f"su -s /bin/sh devcloud -c 'cd {PAIRS_DIR} && sha1sum ref/*'").stdout
        found = {name: sha for sha, name in (line.split() for line in out.splitlines())}
        assert found == expected, (node, found)

    tiny = _make_tiny(provisioned.assets_dir, "tiny-flux2")
    result, run = finetune_other_base(provisioned, "xeonsd/tiny-flux2", tiny, RUN, 2, *data)
    summary = json.loads((run / "train_summary.json").read_text())
    assert (summary["family"], summary["method"], summary["steps"], summary["ranks"]) == ("flux2", "lora", 2, 4)
    assert summary["cond_image_column"] == "cond_image", summary
    (reference,) = summary["sample_references"]
    assert reference.endswith("/pairs/ref/p0.png"), summary
    assert (summary["prompts"]["source"], summary["prompts"]["count"]) == ("metadata.jsonl", 5), summary
    pairs_line = "FLUX.2 [klein], trained at 64 px, on image pairs (the references: metadata.jsonl field cond_image)"
    assert pairs_line in result.output
    report = (run / "report.html").read_text()
    assert "1 reference image(s) per image (the metadata.jsonl field cond_image)" in report, report[-3000:]
    manifest = json.loads((run / "openvino" / "xeonsd_export.json").read_text())
    assert manifest["family"] == "flux2" and manifest["source"].endswith("/models/tiny-flux2"), manifest
    timings = json.loads((run / "images" / "timings.json").read_text())
    assert timings["num_images"] == 5, timings
    assert provisioned.ssh("node1", f"test -f {RUNS}/{RUN}/pytorch_lora_weights.safetensors").returncode == 0
    print(
        f"\nstaging 5 pairs (with ref/) on 4 nodes: {staged.seconds:.1f} s; finetune.yml FLUX.2 [klein] lora on "
        f"pairs (tiny-flux2, 2 steps, 4 ranks): {result.seconds:.1f} s wall (base model staging not counted)"
    )
