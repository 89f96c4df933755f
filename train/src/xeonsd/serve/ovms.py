"""``xeonsd serve --write-ovms-config DIR``: the OpenVINO Model Server configuration that serves the same export
with the same adapters, for sites that already run OVMS.

OVMS routes an images request to the servable its ``model`` field names, so DIR holds one MediaPipe graph per model
``xeonsd serve`` would answer to: ``DIR/<base>/graph.pbtxt`` (the export), and ``DIR/<adapter>/graph.pbtxt`` for each
``--adapter`` (the export with that adapter registered in ``lora_adapters``, a field of ``ImageGenCalculatorOptions``
in current OVMS sources: a release without it refuses that graph). The adapters are written in the kohya layout
GenAI applies (``DIR/adapters/<name>.safetensors``, converted as ``xeonsd serve`` converts them); the graphs point
at the export by its absolute path. ``DIR/config.json`` lists the graphs: ``ovms --config_path DIR/config.json --rest_port 8000``.
Each graph compiles a pipeline of its own (OVMS does not share one between graphs), and the static shape is the
export's (``resolution``, ``num_images_per_prompt``, ``guidance_scale``: OVMS reshapes to it at load). OVMS's
``ImageGenCalculator`` answers ``/v3/images/edits`` (image-to-image, inpainting with a ``mask``) from the same
graph, so the edits need nothing more here; the graphs register no ``composite_lora_adapters``: ``xeonsd serve
--blend``'s blends are not written here (yet), so an OVMS site declares them itself.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from xeonsd.fsutil import atomic_dir
from xeonsd.openvino.generate_args import PRECISIONS
from xeonsd.serve.options import ServedModel, ServeOptions
from xeonsd.serve.prepare import prepare
from xeonsd.serve.requests import DEFAULT_STEPS


def graph_pbtxt(served: ServedModel, opts: ServeOptions, adapter: tuple[str, Path, float] | None) -> str:
    """One OVMS image-generation graph (``ImageGenCalculator``) over the export, with ``adapter`` registered."""
    shape = served.shape
    options = [
        f'models_path: "{Path(served.export_dir).resolve()}"',
        'device: "CPU"',
        *([f"plugin_config: '{json.dumps(PRECISIONS[opts.precision])}'"] if PRECISIONS[opts.precision] else []),
        f'resolution: "{shape.width}x{shape.height}"',
        f'default_resolution: "{shape.width}x{shape.height}"',
        f"num_images_per_prompt: {shape.images_per_call}",
        f"guidance_scale: {served.guidance_scale:g}",
        f"max_num_images_per_prompt: {shape.images_per_call}",
        f"default_num_inference_steps: {min(DEFAULT_STEPS, opts.max_steps)}",
        f"max_num_inference_steps: {opts.max_steps}",
    ]
    if adapter is not None:
        alias, path, alpha = adapter
        options.append(f'lora_adapters: {{ alias: "{alias}" path: "{path}" alpha: {alpha:g} }}')
    body = "\n".join(f"      {line}" for line in options)
    return f"""input_stream: "HTTP_REQUEST_PAYLOAD:input"
output_stream: "HTTP_RESPONSE_PAYLOAD:output"

node: {{
  name: "ImageGenExecutor"
  calculator: "ImageGenCalculator"
  input_stream: "HTTP_REQUEST_PAYLOAD:input"
  input_side_packet: "IMAGE_GEN_NODE_RESOURCES:pipes"
  output_stream: "HTTP_RESPONSE_PAYLOAD:output"
  node_options: {{
    [type.googleapis.com / mediapipe.ImageGenCalculatorOptions]: {{
{body}
    }}
  }}
}}
"""


def write_ovms_config(opts: ServeOptions) -> Path:
    """Check the export and adapters as ``xeonsd serve`` does, then write DIR (atomically); return DIR."""
    assert opts.write_ovms_config is not None
    out = Path(opts.write_ovms_config)
    with tempfile.TemporaryDirectory(prefix="xeonsd-ovms-") as work:
        served = prepare(opts, Path(work))
        with atomic_dir(out) as tmp:
            final_adapters = out.resolve() / "adapters"
            graphs = [(served.name, None)]
            if served.adapters:
                (tmp / "adapters").mkdir()
            for name, (converted, alpha) in served.adapters.items():
                shutil.copyfile(converted, tmp / "adapters" / f"{name}.safetensors")
                graphs.append((name, (name, final_adapters / f"{name}.safetensors", alpha)))
            for name, adapter in graphs:
                (tmp / name).mkdir()
                (tmp / name / "graph.pbtxt").write_text(graph_pbtxt(served, opts, adapter))
            config = {
                "model_config_list": [],
                "mediapipe_config_list": [{"name": n, "base_path": n} for n, _ in graphs],
            }
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
