"""``xeonsd export --quantize hybrid|hybrid-compact``: NNCF int8 through optimum-intel, calibrated offline on our
prompts.

Both methods quantize the UNet's convolutions (weights and input activations) and its matmuls without constant
weights (attention's Q·Kᵀ and ·V, ToMe's similarity) to int8, with ranges calibrated by running the pipeline; on AMX
(or VNNI) those run on the int8 units. The text encoder(s) and the VAE get 8-bit weights (NNCF weight compression,
data-free). They differ in the UNet's linear layers (the matmuls with constant weights):

* ``hybrid`` leaves them as exported: OpenVINO runs them in bf16 on AMX. Measured on a 2-core AMX Xeon, one 512 px
  SD 1.5 UNet call (ToMe 0.75, interleaved): 0.763 s against 0.856 s with int8 weights, which are decompressed to
  bf16 on every call (``FullyConnectedCompressed``) and so cost more than they save where the math is on AMX.
* ``hybrid-compact`` is optimum-intel's ``quant_method="hybrid"``: their weights are compressed to int8 too, the
  UNet file a quarter of the size (SD 1.5: 0.86 GB against 3.4 GB in fp32) for nodes short of memory or disk.

The calibration is ours, not optimum-intel's dataset builder: the pipeline (already reshaped to the export's
static shape, so the ranges are measured at the size it will run) makes images from the user's prompts, or the
recipe's prompt and the textual-inversion object templates with the export's concept token, each call seeded
(``seed + k``), ``CALIBRATION_STEPS`` denoising steps a call, until ``samples`` UNet calls are recorded. Those UNet
inputs are handed to ``OVQuantizer`` as an ``OVCalibrationDataset``, and the config carries no ``dataset`` name, so
nothing is ever downloaded. What was used is recorded in the export manifest (:func:`manifest_entry`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xeonsd.openvino.manifest import StaticShape

log = logging.getLogger(__name__)

HYBRID, HYBRID_COMPACT = METHODS = ("hybrid", "hybrid-compact")
DEFAULT_SAMPLES = 100  # UNet calls recorded for calibration (NNCF's samples); optimum-intel's default is 200
CALIBRATION_STEPS = 10  # denoising steps per calibration call: more prompts for the same number of UNet calls
CALIBRATION_SEED = 0
RECIPE_TOKEN = "<dicoo>"


class QuantizeError(ValueError):
    """The quantization cannot be done with these inputs."""


@dataclass(frozen=True)
class QuantizeOptions:
    """``--quantize METHOD [--calibration-prompts FILE] [--calibration-samples N]``."""

    method: str = "hybrid"
    prompts_file: Path | None = None  # None: the recipe's prompt and templates
    samples: int = DEFAULT_SAMPLES


def check_options(opts: QuantizeOptions, weight_format: str) -> None:
    """Refuse bad input before anything heavy is loaded."""
    if opts.method not in METHODS:
        raise QuantizeError(f"unknown --quantize {opts.method!r}; choose one of {', '.join(METHODS)}")
    if weight_format != "int8":
        raise QuantizeError(
            f"--quantize {opts.method} stores 8-bit weights and cannot be combined with --weight-format "
            f"{weight_format}; drop --weight-format (or pass int8)"
        )
    if opts.samples < 1:
        raise QuantizeError(f"--calibration-samples must be at least 1, got {opts.samples}")
    if opts.prompts_file is not None:
        read_prompts(opts.prompts_file)


def read_prompts(path: Path) -> list[str]:
    """One prompt a line; blank lines and lines starting with ``#`` are skipped. Empty or missing: an error."""
    path = Path(path)
    if not path.is_file():
        raise QuantizeError(f"--calibration-prompts {path} does not exist or is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise QuantizeError(f"--calibration-prompts {path} cannot be read: {exc}") from exc
    prompts = [line.strip() for line in text.splitlines()]
    prompts = [p for p in prompts if p and not p.startswith("#")]
    if not prompts:
        raise QuantizeError(f"--calibration-prompts {path} holds no prompts (one prompt a line)")
    return prompts


def default_prompts(concept_tokens: list[str]) -> list[str]:
    """The recipe's prompt, then the textual-inversion object templates, with the export's concept token."""
    from xeonsd.openvino.generate_args import RECIPE_PROMPT
    from xeonsd.templates import OBJECT_TEMPLATES

    token = next((t for t in concept_tokens if not t.rsplit("_", 1)[-1].isdigit()), None) or RECIPE_TOKEN
    return [RECIPE_PROMPT.replace(RECIPE_TOKEN, token), *(t.format(token) for t in OBJECT_TEMPLATES)]


def calibration_size(pipe: Any) -> tuple[int, int]:
    """The size the calibration images are made at: the static shape's, else optimum-intel's choice."""
    if pipe.height > 0 and pipe.width > 0:
        return pipe.height, pipe.width
    size = min(int(pipe.unet.config.get("sample_size", 64)) * pipe.vae_scale_factor, 512)
    return size, size


def collect_unet_inputs(
    pipe: Any, prompts: list[str], samples: int, prompts_per_call: int, images_per_prompt: int
) -> tuple[list[Any], list[str], int]:
    """Run the pipeline on ``prompts`` (cycled, call k seeded ``CALIBRATION_SEED + k``) until ``samples`` UNet
    calls are recorded; return them, the prompts run (in order) and the number of pipeline calls."""
    import torch
    from optimum.intel.openvino.quantization import InferRequestWrapper

    height, width = calibration_size(pipe)
    pipe.compile()
    pipe.set_progress_bar_config(disable=True)
    recorded: list[Any] = []
    used: list[str] = []
    unet = pipe.unet
    unet.request = InferRequestWrapper(unet.request, recorded)
    calls = 0
    try:
        while len(recorded) < samples:
            batch = [prompts[(calls * prompts_per_call + i) % len(prompts)] for i in range(prompts_per_call)]
            pipe(
                prompt=batch,
                num_images_per_prompt=images_per_prompt,
                num_inference_steps=CALIBRATION_STEPS,
                height=height,
                width=width,
                generator=torch.Generator("cpu").manual_seed(CALIBRATION_SEED + calls),
                output_type="latent",  # the VAE decoder's output is not needed
            )
            used.extend(batch)
            calls += 1
            if not recorded:  # never loop forever on a pipeline that does not reach the UNet
                raise QuantizeError("the calibration call did not run the UNet; cannot calibrate")
    finally:
        unet.request = unet.request.request
    return recorded[:samples], used, calls


WEIGHTS = {
    HYBRID: "int8 (text encoders, VAE, UNet convolutions); the UNet's linear layers as exported",
    HYBRID_COMPACT: "int8 (every network)",
}


def weighted_matmuls(model: Any) -> list[str]:
    """The names of the MatMuls of an OpenVINO ``model`` that multiply by a constant (a linear layer's weight, maybe
    behind a Convert or Reshape): the layers ``hybrid`` leaves out of the quantization."""
    names = []
    for op in model.get_ops():
        if op.get_type_name() != "MatMul":
            continue
        for value in op.input_values():
            node = value.get_node()
            while node.get_type_name() in ("Convert", "Reshape", "Transpose") and node.get_input_size() > 0:
                node = node.input_value(0).get_node()
            if node.get_type_name() == "Constant":
                names.append(op.get_friendly_name())
                break
    return names


def quantization_config(method: str, unet: Any, samples: int) -> Any:
    """optimum-intel's config for ``method``, given the UNet's OpenVINO model and the calibration set's size."""
    from optimum.intel import OVPipelineQuantizationConfig, OVQuantizationConfig, OVWeightQuantizationConfig

    if method == HYBRID_COMPACT:
        return OVWeightQuantizationConfig(bits=8, quant_method="hybrid", num_samples=samples)
    if method != HYBRID:
        raise QuantizeError(f"unknown --quantize {method!r}; choose one of {', '.join(METHODS)}")
    # optimum-intel's hybrid, less its weight compression of the UNet's linear layers: those are ignored by the
    # full quantization as they are there, and no weight compression runs on the UNet at all.
    unet_config = OVQuantizationConfig(
        ignored_scope={"names": weighted_matmuls(unet)}, num_samples=samples, smooth_quant_alpha=-1
    )
    return OVPipelineQuantizationConfig({"unet": unet_config}, default_config=OVWeightQuantizationConfig(bits=8))


def quantize_pipeline(
    pipe: Any, opts: QuantizeOptions, concept_tokens: list[str], static: StaticShape | None
) -> dict[str, Any]:
    """Quantize ``pipe`` (an optimum-intel diffusion pipeline, already reshaped to ``static`` or dynamic) in place
    by ``opts.method``; return what the manifest records."""
    import nncf
    from optimum.intel import OVCalibrationDataset, OVConfig, OVQuantizer

    if opts.prompts_file is not None:
        prompts, source = read_prompts(opts.prompts_file), str(opts.prompts_file)
    else:
        prompts, source = default_prompts(concept_tokens), "recipe prompt and object templates"
    # A static export takes exactly batch_size prompts x num_images_per_prompt images a call.
    per_call, per_prompt = (1, 1) if static is None else (static.batch_size, static.num_images_per_prompt)
    t0 = time.perf_counter()
    log.info("calibrating on %d prompt(s) from %s: %d UNet call(s)", len(prompts), source, opts.samples)
    data, used, calls = collect_unet_inputs(pipe, prompts, opts.samples, per_call, per_prompt)
    calib_s = time.perf_counter() - t0
    height, width = calibration_size(pipe)
    # No ``dataset`` in the config: optimum-intel's dataset builder (which downloads) is never reached.
    config = quantization_config(opts.method, pipe.unet.model, len(data))
    t0 = time.perf_counter()
    OVQuantizer(pipe).quantize(
        calibration_dataset=OVCalibrationDataset({"unet": nncf.Dataset(data)}),
        ov_config=OVConfig(quantization_config=config),
    )
    return {
        "method": opts.method,
        "weights": WEIGHTS[opts.method],
        "activations": "int8 (UNet convolutions and matmuls without constant weights)",
        "calibration": {
            "prompts_source": source,
            "prompts": used,
            "distinct_prompts": len(dict.fromkeys(used)),
            "pipeline_calls": calls,
            "samples": len(data),
            "steps_per_call": CALIBRATION_STEPS,
            "seed": CALIBRATION_SEED,
            "height": height,
            "width": width,
            "seconds": round(calib_s, 1),
        },
        "quantize_seconds": round(time.perf_counter() - t0, 1),
    }
