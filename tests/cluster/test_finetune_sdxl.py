"""finetune.yml with an SDXL base model on the real 4-node test cluster: tiny-xl staged as a second base model, a
LoRA trained at the family's resolution, the SDXL base exported and the images generated with the adapter."""

from __future__ import annotations

import json

from harness import Cluster
from jobs import finetune_other_base


def test_sdxl_lora_trains_at_the_familys_resolution_exports_the_sdxl_base_and_generates_with_it(
    provisioned: Cluster,
) -> None:
    """An SDXL base_model_id through the same playbooks: tiny-xl staged as a second base model (the base_model role,
    per base_model_id), a LoRA trained with finetune_resolution auto (tiny-xl's own 64 px), the summary, the play
    and the report naming SDXL and 64 px, the adapter loading into diffusers' SDXL pipeline, the base export being
    SDXL at 64x64 and xeonsd generate applying the adapter through GenAI."""
    from assets import make_tiny_xl

    tiny_xl = make_tiny_xl(provisioned.assets_dir)
    result, run = finetune_other_base(provisioned, "xeonsd/tiny-xl", tiny_xl, "sdxl-lora", steps=6)
    summary = json.loads((run / "train_summary.json").read_text())
    assert (summary["family"], summary["resolution"], summary["steps"]) == ("sdxl", 64, 6), summary
    assert "--resolution=auto" in (run / "run.sh").read_text()  # auto: the trainer chose the family's
    assert "model family:      SDXL, trained at 64 px" in result.output
    assert "<td>SDXL, 64 px</td>" in (run / "report.html").read_text()

    manifest = json.loads((run / "openvino" / "xeonsd_export.json").read_text())
    assert manifest["family"] == "sdxl" and manifest["source"].endswith("/models/tiny-xl"), manifest
    assert (manifest["static_shape"]["height"], manifest["static_shape"]["width"]) == (64, 64), manifest
    timings = json.loads((run / "images" / "timings.json").read_text())
    assert timings["engine"] == "genai" and timings["num_images"] == 5, timings  # --lora runs through GenAI
    generate = next(
        e["event_data"]["res"]["cmd"]
        for e in result.events
        if e.get("event") == "runner_on_ok" and e["event_data"].get("task", "").startswith("Generate the images")
    )
    assert generate[generate.index("--lora") + 1].endswith("/sdxl-lora/pytorch_lora_weights.safetensors:1.0")

    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_xl)
    pipe.load_lora_weights(run, weight_name="pytorch_lora_weights.safetensors")
    assert any("lora" in name for name, _ in pipe.unet.named_parameters())
    print(f"\nfinetune.yml SDXL lora (tiny-xl, 6 steps, 4 ranks): {result.seconds:.1f} s wall (staging not counted)")
