"""Session fixtures for the OpenVINO tests: a concept, a full pipeline holding it, and three tiny exports.

Exports are the slow part (~20 s of CPU each on the tiny model), so each is made once a session and shared:

* ``ov_baked``: base model + ``--embeds`` (the concept added by xeonsd), static, the recipe's call shape
  (batch 5, 1 image per prompt) at 64 px;
* ``ov_base``: the base model without the concept, same static shape (for ``generate --embeds``);
* ``ov_full_dynamic``: the ``--save_as_full_pipeline`` kind of source, written by diffusers'
  ``load_textual_inversion`` + ``save_pretrained``, exported with ``--dynamic``;
* the flow-matching families: ``ov_flux`` (tiny-flux through the CLI, its default size, for the GenAI adapter),
  ``ov_flux_lora`` (the same with ``flux_lora`` fused in) and ``ov_sd3_lora`` (tiny-sd3 with ``sd3_lora`` fused in); ``flux_lora``/``sd3_lora`` are
  adapters made the way diffusers' scripts make them (peft on the transformer and CLIP-L, ``save_lora_weights``).

The conftest beside this file makes the fixtures visible to every test here; the constants are imported.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

TOKEN = "<dicoo>"
PROMPT = "a yellow <dicoo> robot at the beach, high quality"
SIZE = 64
STEPS = 3
BATCH = 5


@pytest.fixture(scope="session")
def embeds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-vector concept in the trainer's format; large vectors, so the concept visibly changes the images."""
    gen = torch.Generator().manual_seed(3)
    path = tmp_path_factory.mktemp("concept") / "learned_embeds.safetensors"
    save_file({TOKEN: torch.randn(2, 32, generator=gen) * 2.0}, str(path))
    return path


@pytest.fixture(scope="session")
def full_pipeline(tiny_model: Path, embeds: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What ``--save_as_full_pipeline`` writes, made with diffusers' own textual-inversion loader."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None, requires_safety_checker=False)
    pipe.load_textual_inversion(str(embeds))
    out = tmp_path_factory.mktemp("full") / "pipeline"
    pipe.save_pretrained(out, safe_serialization=True)
    return out


def _export(src: Path, out: Path, **kwargs) -> Path:
    from xeonsd.openvino.export import ExportOptions, export
    from xeonsd.openvino.manifest import StaticShape

    static = StaticShape(batch_size=BATCH, height=SIZE, width=SIZE, num_images_per_prompt=1)
    kwargs.setdefault("static", static)
    return export(str(src), out, ExportOptions(**kwargs))


@pytest.fixture(scope="session")
def ov_baked(tiny_model: Path, embeds: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _export(tiny_model, tmp_path_factory.mktemp("ov") / "baked", embeds=embeds)


@pytest.fixture(scope="session")
def ov_base(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _export(tiny_model, tmp_path_factory.mktemp("ov") / "base")


@pytest.fixture(scope="session")
def ov_full_dynamic(full_pipeline: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _export(full_pipeline, tmp_path_factory.mktemp("ov") / "full-dynamic", static=None)


def peft_adapter(unet, out: Path, targets: list[str], seed: int, scale: float) -> Path:
    """An adapter written the way our trainer writes one (peft -> diffusers layout -> ``save_lora_weights``), with
    random up matrices of std ``scale`` (peft starts them at zero), so it visibly changes the image."""
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    unet.add_adapter(LoraConfig(r=2, lora_alpha=2, init_lora_weights="gaussian", target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in unet.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    StableDiffusionPipeline.save_lora_weights(out, unet_lora_layers=layers, safe_serialization=True)
    return out / "pytorch_lora_weights.safetensors"


def as_array(images: list) -> np.ndarray:
    """PIL images -> float array [n, h, w, 3] in 0..255."""
    return np.stack([np.asarray(img, dtype=np.float64) for img in images])


def torch_images(pipe, prompt: str, seed: int) -> np.ndarray:
    """A stock diffusers pipeline's BATCH images of ``prompt`` at SIZE, STEPS steps, seeded: uint8 levels as floats."""
    import torch

    out = pipe(
        prompt=[prompt] * BATCH,
        num_inference_steps=STEPS,
        height=SIZE,
        width=SIZE,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
    )
    return np.round(out.images.astype(np.float64) * 255.0)


def linear_weight_types(ov_dir: Path) -> set[str]:
    """The element types of the constants behind the weights of the UNet's attention and feed-forward linear layers
    in the export ``ov_dir``: only float types when they are stored as exported, i8/u8 when compressed to int8."""
    import openvino as ov

    model = ov.Core().read_model(ov_dir / "unet" / "openvino_model.xml")
    linears = [
        op
        for op in model.get_ops()
        if op.get_type_name() == "MatMul" and any(k in op.get_friendly_name() for k in (".to_q/", ".ff.net."))
    ]
    assert linears, "no attention or feed-forward linear layer found in the UNet"
    types: set[str] = set()
    for op in linears:
        stack = [op.input_value(1).get_node()]
        while stack:
            node = stack.pop()
            kind = node.get_type_name()
            if kind == "Constant":
                types.add(node.get_element_type().get_type_name())
            elif kind in ("Convert", "Subtract", "Multiply", "Reshape", "Transpose"):
                stack.extend(value.get_node() for value in node.input_values())
    return types


FLOW_LORA = "pytorch_lora_weights.safetensors"
# diffusers' default FLUX/SD3 LoRA targets (train_dreambooth_lora_flux.py / _sd3.py) and CLIP's attention
FLOW_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"]
CLIP_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]


def flow_lora(model: Path, family: str, out: Path, scale: float = 2.0) -> Path:
    """A LoRA (rank 2, alpha 4) on the transformer's attention and CLIP-L with random up matrices, saved by the
    family's diffusers pipeline with its alphas: what a trainer following diffusers' scripts writes."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from xeonsd.families import by_name
    from xeonsd.openvino.pipelines import load_torch_pipeline

    pipe = load_torch_pipeline(str(model), by_name(family))
    gen = torch.Generator().manual_seed(0)
    for part, targets in ((pipe.transformer, FLOW_TARGETS), (pipe.text_encoder, CLIP_TARGETS)):
        part.add_adapter(LoraConfig(r=2, lora_alpha=4, init_lora_weights="gaussian", target_modules=targets))
        with torch.no_grad():
            for name, p in part.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * scale)
    type(pipe).save_lora_weights(
        out,
        transformer_lora_layers=get_peft_model_state_dict(pipe.transformer),
        transformer_lora_adapter_metadata=pipe.transformer.peft_config["default"].to_dict(),
        text_encoder_lora_layers=convert_state_dict_to_diffusers(get_peft_model_state_dict(pipe.text_encoder)),
        text_encoder_lora_adapter_metadata=pipe.text_encoder.peft_config["default"].to_dict(),
        safe_serialization=True,
    )
    return out / FLOW_LORA


@pytest.fixture(scope="session")
def flux_lora(tiny_flux_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return flow_lora(tiny_flux_model, "flux", tmp_path_factory.mktemp("flux-lora"))


@pytest.fixture(scope="session")
def sd3_lora(tiny_sd3_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return flow_lora(tiny_sd3_model, "sd3", tmp_path_factory.mktemp("sd3-lora"))


@pytest.fixture(scope="session")
def ov_flux(tiny_flux_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-flux through the CLI with no size: the static shape of its config (64 px), batch 1."""
    from xeonsd import cli

    out = tmp_path_factory.mktemp("ov-flux") / "base"
    assert cli.main(["export", str(tiny_flux_model), str(out), "--batch-size", "1"]) == 0
    return out


@pytest.fixture(scope="session")
def ov_flux_lora(tiny_flux_model: Path, flux_lora: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-flux with ``flux_lora`` fused in (``export --lora``), batch 1, 64 px."""
    from xeonsd import cli

    out = tmp_path_factory.mktemp("ov-flux") / "lora"
    assert cli.main(["export", str(tiny_flux_model), str(out), "--batch-size", "1", "--lora", str(flux_lora)]) == 0
    return out


@pytest.fixture(scope="session")
def ov_sd3_lora(tiny_sd3_model: Path, sd3_lora: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-sd3 with ``sd3_lora`` fused in (``export --lora``: SD3 has no GenAI adapters), batch 1, 64 px."""
    from xeonsd import cli

    out = tmp_path_factory.mktemp("ov-sd3") / "lora"
    assert cli.main(["export", str(tiny_sd3_model), str(out), "--batch-size", "1", "--lora", str(sd3_lora)]) == 0
    return out


def cli_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``xeonsd ARGS`` refused (exit 2): its one ``xeonsd …: error:`` line, with no traceback."""
    from xeonsd import cli

    assert cli.main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("xeonsd ")]
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err
    return lines[0]
