"""finetune.yml and serve.yml with a Z-Image base model on the real 4-node test cluster:
tiny-zimage staged as another base model, a LoRA trained with Z-Image's flow objective over the ranks, and, because
OpenVINO GenAI applies no adapters to Z-Image, the adapter fused into the run's own export (not the base model's
shared one); the images generated from it, and serve.yml serving that export alone behind the front."""

from __future__ import annotations

import json

from harness import Cluster
from jobs import RUNS, finetune_other_base
from serving import Front, serve_play, serve_processes, servers_killed_after

RUN = "zimage-lora"


def test_zimage_lora_trains_over_the_ranks_fuses_into_its_own_export_and_is_served(provisioned: Cluster) -> None:
    """A Tongyi-MAI/Z-Image base_model_id through the same playbooks as SD: the family's resolution (tiny-zimage:
    64 px) and objective in the summary and the report; export.yml fuses the adapter into the run's own export
    (a directory of the run, its manifest naming the LoRA) and generates without --lora; serve.yml serves that
    export under the run's name with no adapter registered, and stops it again."""
    from assets import _make_tiny

    tiny = _make_tiny(provisioned.assets_dir, "tiny-zimage")
    result, run = finetune_other_base(provisioned, "xeonsd/tiny-zimage", tiny, RUN, steps=4)
    summary = json.loads((run / "train_summary.json").read_text())
    assert (summary["family"], summary["resolution"], summary["steps"], summary["ranks"]) == ("zimage", 64, 4, 4)
    assert summary["loss"]["objective"] == "flow", summary["loss"]
    assert "model family:      Z-Image, trained at 64 px" in result.output
    assert "Z-Image, 64 px" in (run / "report.html").read_text()

    manifest = json.loads((run / "openvino" / "xeonsd_export.json").read_text())
    assert manifest["family"] == "zimage" and manifest["source"].endswith("/models/tiny-zimage"), manifest
    assert manifest["lora"] is not None and manifest["lora"]["file"].endswith(
        f"/{RUN}/pytorch_lora_weights.safetensors"
    )
    assert (manifest["static_shape"]["height"], manifest["static_shape"]["width"]) == (64, 64), manifest
    assert "GenAI applies no adapters to Z-Image" in result.output
    own = provisioned.ssh("node1", f"test -d {RUNS}/{RUN}/openvino && test ! -L {RUNS}/{RUN}/openvino")
    assert own.returncode == 0, "the fused export is the run's own directory, not a link to the base's"
    timings = json.loads((run / "images" / "timings.json").read_text())
    assert timings["engine"] == "genai" and timings["num_images"] == 5, timings

    front = Front(provisioned)
    with servers_killed_after(provisioned):
        serve_play(provisioned, "serve-zimage", "-e", f"serve_run={RUN}")
        assert [m["id"] for m in front.get("/v1/models")["data"]] == [RUN]  # the fused export alone, by the run's name
        code, image = front.image()
        assert code == 200 and image.size == (64, 64), image
        serve_play(
            provisioned, "serve-zimage-stopped", "-e", f"serve_run={RUN}", "-e", "serve_state=stopped", timeout=600
        )
        assert serve_processes(provisioned) == {}
    print(
        f"\nfinetune.yml Z-Image lora (tiny-zimage, 4 steps, 4 ranks): {result.seconds:.1f} s wall (staging not counted)"
    )
