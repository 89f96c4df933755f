"""finetune.yml and serve.yml with a Z-Image base model on the real 4-node test cluster, the run a masked LoKr:
tiny-zimage staged as another base model, the images staged with their masks (a masks/ subfolder the dataset role
stages because finetune_masks names it under dataset_dir), a LoKr trained on the masked loss with Z-Image's flow
objective over the ranks, and, because OpenVINO GenAI applies no adapters to Z-Image (and plain LoRA only where it
does), the adapter fused into the run's own export (not the base model's shared one); the images generated from
it, and serve.yml serving that export alone behind the front, asked through the ``openai`` client."""

from __future__ import annotations

import base64
import io
import json
import shutil
from pathlib import Path

from harness import Cluster
from jobs import RUNS, finetune_other_base, stage_dataset
from PIL import Image, ImageDraw
from serving import Front, serve_play, serve_processes, servers_killed_after

RUN = "zimage-lokr-masked"
DATA = "/home/devcloud/dicoo-masked"
SERVING = ["node1", "node2"]  # the nodes that serve the fused export


def masked_dataset(cluster: Cluster) -> Path:
    """The dicoo images and captions, and in masks/ one mask per image (its stem and size): an ellipse around the
    middle white, the rest black."""
    src = cluster.assets_dir / "dicoo-masked"
    if not src.exists():
        tmp = src.with_name(src.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(cluster.assets_dir / "dicoo", tmp)
        (tmp / "masks").mkdir()
        for image in sorted(tmp.glob("*.png")):
            w, h = Image.open(image).size
            mask = Image.new("L", (w, h), 0)
            ImageDraw.Draw(mask).ellipse((w // 4, h // 4, 3 * w // 4, 3 * h // 4), fill=255)
            mask.save(tmp / "masks" / image.name)
        tmp.rename(src)
    return src


def test_a_masked_zimage_lokr_trains_over_the_ranks_fuses_into_its_own_export_and_is_served(
    provisioned: Cluster,
) -> None:
    """A Tongyi-MAI/Z-Image base_model_id through the same playbooks as SD: the family's resolution (tiny-zimage:
    64 px) and objective, the LoKr and the masks in the summary and the log; export.yml fuses the adapter into the
    run's own export (a directory of the run, its manifest naming the adapter file) and generates without --lora;
    serve.yml serves that export on two nodes under the run's name with no adapter registered."""
    import httpx
    import openai
    from assets import _make_tiny

    tiny = _make_tiny(provisioned.assets_dir, "tiny-zimage")
    source = masked_dataset(provisioned)
    data = ("-e", f"dataset_dir={DATA}", "-e", f"finetune_masks={DATA}/masks")
    stage_dataset(provisioned, "stage-masked", source, *data)
    for node in provisioned.nodes:  # the masks went with the images (dataset_recurse's default), as the job reads them
        out = provisioned.ssh(node, f"su -s /bin/sh devcloud -c 'ls {DATA}/masks'").stdout.split()
        assert out == sorted(p.name for p in (source / "masks").iterdir()), (node, out)

    result, run = finetune_other_base(
        provisioned, "xeonsd/tiny-zimage", tiny, RUN, 4, *data, "-e", "finetune_adapter=lokr"
    )
    summary = json.loads((run / "train_summary.json").read_text())
    assert (summary["family"], summary["resolution"], summary["steps"], summary["ranks"]) == ("zimage", 64, 4, 4)
    assert summary["loss"]["objective"] == "flow", summary["loss"]
    assert summary["adapter"] == "lokr", summary
    assert f"masked loss: 5 mask(s) from {DATA}/masks" in (run / "train.log").read_text()
    assert "model family:      Z-Image, trained at 64 px" in result.output
    assert "Z-Image, 64 px" in (run / "report.html").read_text()

    manifest = json.loads((run / "openvino" / "xeonsd_export.json").read_text())
    assert manifest["family"] == "zimage" and manifest["source"].endswith("/models/tiny-zimage"), manifest
    assert manifest["lora"] is not None and manifest["lora"]["file"].endswith(f"/{RUN}/adapter_model.safetensors")
    assert (manifest["static_shape"]["height"], manifest["static_shape"]["width"]) == (64, 64), manifest
    assert "the lokr adapter fused into the base model: GenAI applies plain LoRA only" in result.output
    own = provisioned.ssh("node1", f"test -d {RUNS}/{RUN}/openvino && test ! -L {RUNS}/{RUN}/openvino")
    assert own.returncode == 0, "the fused export is the run's own directory, not a link to the base's"
    timings = json.loads((run / "images" / "timings.json").read_text())
    assert timings["engine"] == "genai" and timings["num_images"] == 5, timings

    front = Front(provisioned)
    with servers_killed_after(provisioned):
        # Two of the nodes serve it (serve_hosts): the front and its rotation are test_serve.py's, over all four;
        # here the point is the fused transformer export answering, and each server compiles it (CPU).
        serve_play(provisioned, "serve-zimage", "-e", f"serve_run={RUN}", "-e", json.dumps({"serve_hosts": SERVING}))
        assert [m["id"] for m in front.get("/v1/models")["data"]] == [RUN]  # the fused export alone, by the run's name
        # no serve_api_keys on this run: the server takes any request, and the client needs some key to send
        api = openai.OpenAI(
            base_url=f"{front.url}/v1", api_key="none-set", http_client=httpx.Client(verify=front.ca), max_retries=0
        )
        made = api.images.generate(
            model=RUN, prompt="a photo of a toy", response_format="b64_json", extra_body={"num_inference_steps": 2}
        )
        image = Image.open(io.BytesIO(base64.b64decode(made.data[0].b64_json)))
        assert image.size == (64, 64), image
        assert set(serve_processes(provisioned)) == set(SERVING)  # one server per serving node, none elsewhere
    # (serve_state=stopped is test_serve.py's: here the servers are killed on the way out.)
    assert serve_processes(provisioned) == {}
    print(
        f"\nfinetune.yml Z-Image masked LoKr (tiny-zimage, 4 steps, 4 ranks): {result.seconds:.1f} s wall "
        "(staging not counted)"
    )
