"""finetune.yml with a FLUX.1 base model on the real 4-node test cluster: tiny-flux staged as another base model, a
LoRA trained with rectified flow over the ranks, the FLUX base exported and the images generated with the adapter
through GenAI."""

from __future__ import annotations

import json

from harness import Cluster
from jobs import finetune_other_base


def test_flux_lora_trains_over_the_ranks_exports_the_flux_base_and_generates_with_the_adapter(
    provisioned: Cluster,
) -> None:
    """A FLUX.1-dev base_model_id through the same playbooks as SD: the family's resolution (tiny-flux: 64 px), its σ
    sampling in the summary and the report, the adapter in diffusers' transformer layout loading into stock
    FluxPipeline, the base export being FLUX at 64x64, and xeonsd generate applying the adapter through GenAI."""
    from assets import make_tiny_flux

    tiny_flux = make_tiny_flux(provisioned.assets_dir)
    result, run = finetune_other_base(provisioned, "xeonsd/tiny-flux", tiny_flux, "flux-lora", steps=4)
    summary = json.loads((run / "train_summary.json").read_text())
    assert (summary["family"], summary["resolution"], summary["steps"], summary["ranks"]) == ("flux", 64, 4, 4)
    assert summary["loss"]["objective"] == "flow", summary["loss"]
    assert "model family:      FLUX.1, trained at 64 px" in result.output
    report = (run / "report.html").read_text()
    assert "FLUX.1, 64 px" in report and "σ sampling" in report

    manifest = json.loads((run / "openvino" / "xeonsd_export.json").read_text())
    assert manifest["family"] == "flux" and manifest["source"].endswith("/models/tiny-flux"), manifest
    assert (manifest["static_shape"]["height"], manifest["static_shape"]["width"]) == (64, 64), manifest
    timings = json.loads((run / "images" / "timings.json").read_text())
    assert timings["engine"] == "genai" and timings["num_images"] == 5, timings  # --lora runs through GenAI

    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(tiny_flux)
    pipe.load_lora_weights(run, weight_name="pytorch_lora_weights.safetensors")
    assert any("lora" in name for name, _ in pipe.transformer.named_parameters())
    print(f"\nfinetune.yml FLUX lora (tiny-flux, 4 steps, 4 ranks): {result.seconds:.1f} s wall (staging not counted)")
