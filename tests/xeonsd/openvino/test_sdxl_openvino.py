"""SDXL on the OpenVINO side, on tiny-xl: the export (family, default resolution, both tokenizers), the concept in
both text encoders, the LoRA fused into an export and applied by GenAI (UNet and both text encoders) give the images
diffusers PyTorch gives; adapters and embeddings of the other family are refused naming both.

Two exports, made once for the module: the base model through the CLI (its default size is the family's, 64 px
for tiny-xl) and the base model with the concept and the LoRA fused in. Images are uint8 pixels (0..255); "mean" is
the mean absolute difference over all pixels.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from ov_assets import as_array, cli_error

from xeonsd import cli
from xeonsd.modelfiles.concept_file import ConceptError, load_xl_concept, save_xl_concept
from xeonsd.openvino.generate import GenerateOptions, generate
from xeonsd.openvino.manifest import MANIFEST

TOKEN = "<xlcat>"
PROMPT = f"a photo of {TOKEN} toy"
SIZE = 64  # tiny-xl's default resolution (sample_size 8 x VAE scale 8)
STEPS = 3
SEED = 5
LORA_FILE = "pytorch_lora_weights.safetensors"


def _add_lora(model, targets: list[str], gen: torch.Generator, scale: float) -> dict:
    """A peft LoRA on ``model`` with random up matrices (peft starts them at zero); its diffusers-layout layers."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    model.add_adapter(LoraConfig(r=2, lora_alpha=2, init_lora_weights="gaussian", target_modules=targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return convert_state_dict_to_diffusers(get_peft_model_state_dict(model))


@pytest.fixture(scope="module")
def xl_lora(tiny_xl_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An SDXL LoRA on the UNet's attention and both text encoders, saved by ``StableDiffusionXLPipeline``."""
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_xl_model)
    gen = torch.Generator().manual_seed(0)
    attn, clip = ["to_q", "to_k", "to_v", "to_out.0"], ["q_proj", "k_proj", "v_proj", "out_proj"]
    out = tmp_path_factory.mktemp("xl-lora")
    StableDiffusionXLPipeline.save_lora_weights(
        out,
        unet_lora_layers=_add_lora(pipe.unet, attn, gen, 0.3),
        text_encoder_lora_layers=_add_lora(pipe.text_encoder, clip, gen, 0.3),
        text_encoder_2_lora_layers=_add_lora(pipe.text_encoder_2, clip, gen, 0.3),
        safe_serialization=True,
    )
    return out / LORA_FILE


@pytest.fixture(scope="module")
def xl_embeds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An SDXL concept (two vectors per encoder) in the community layout, written by our writer."""
    gen = torch.Generator().manual_seed(3)
    path = tmp_path_factory.mktemp("xl-concept") / "learned_embeds.safetensors"
    return save_xl_concept(path, TOKEN, torch.randn(2, 32, generator=gen) * 2, torch.randn(2, 32, generator=gen) * 2)


@pytest.fixture(scope="module")
def ov_xl(tiny_xl_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The base export through the CLI, no size given: the family's resolution."""
    out = tmp_path_factory.mktemp("ov-xl") / "base"
    assert cli.main(["export", str(tiny_xl_model), str(out), "--batch-size", "1"]) == 0
    return out


@pytest.fixture(scope="module")
def ov_xl_fused(tiny_xl_model: Path, xl_embeds: Path, xl_lora: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ov-xl") / "fused"
    args = ["export", str(tiny_xl_model), str(out), "--batch-size", "1", "--embeds", str(xl_embeds)]
    assert cli.main([*args, "--lora", str(xl_lora), "--resolution", str(SIZE)]) == 0
    return out


def _images(ov_dir: Path, engine: str, **kwargs) -> np.ndarray:
    opts = GenerateOptions(prompts=(PROMPT,), num_images=2, steps=STEPS, seed=SEED, engine=engine, **kwargs)
    images, _ = generate(ov_dir, opts)
    return as_array(images)


def _diffusers(model: Path, embeds: Path | None, lora: Path | None) -> np.ndarray:
    """Stock diffusers: the concept with the two documented ``load_textual_inversion`` calls, the LoRA with
    ``load_lora_weights``; seeds ``SEED`` and ``SEED + 1`` as ``generate`` uses them."""
    from diffusers import StableDiffusionXLPipeline
    from safetensors.torch import load_file

    pipe = StableDiffusionXLPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    if embeds is not None:
        state = load_file(str(embeds))
        pipe.load_textual_inversion(
            state["clip_l"], token=TOKEN, text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer
        )
        pipe.load_textual_inversion(
            state["clip_g"], token=TOKEN, text_encoder=pipe.text_encoder_2, tokenizer=pipe.tokenizer_2
        )
    if lora is not None:
        pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    images = []
    for k in range(2):
        out = pipe(
            prompt=PROMPT,
            num_inference_steps=STEPS,
            height=SIZE,
            width=SIZE,
            generator=torch.Generator().manual_seed(SEED + k),
            output_type="np",
        )
        images.append(np.round(out.images[0].astype(np.float64) * 255.0))
    return np.stack(images)


def test_sdxl_export_has_the_family_resolution_and_both_tokenizers(ov_xl: Path, ov_xl_fused: Path) -> None:
    manifest = json.loads((ov_xl / MANIFEST).read_text())
    assert manifest["family"] == "sdxl"
    assert manifest["static_shape"] == {"batch_size": 1, "height": SIZE, "width": SIZE, "num_images_per_prompt": 1}
    assert {"text_encoder_2", "openvino_tokenizer", "openvino_tokenizer_2"} <= set(manifest["components"])
    fused = json.loads((ov_xl_fused / MANIFEST).read_text())
    assert fused["concept_tokens"] == [TOKEN, f"{TOKEN}_1"] and fused["lora"]["scale"] == 1.0
    assert fused["source_fingerprint"] == manifest["source_fingerprint"]
    from transformers import CLIPTokenizer

    for tokenizer in ("tokenizer", "tokenizer_2"):
        added = CLIPTokenizer.from_pretrained(ov_xl_fused / tokenizer).get_added_vocab()
        assert TOKEN in added and f"{TOKEN}_1" in added, tokenizer


def test_sdxl_fused_export_and_genai_adapter_agree_with_diffusers(
    tiny_xl_model: Path, xl_embeds: Path, xl_lora: Path, ov_xl: Path, ov_xl_fused: Path
) -> None:
    """Same seeds, scheduler, concept and adapter (UNet + both text encoders): diffusers PyTorch (the two
    ``load_textual_inversion`` calls, ``load_lora_weights``), the fused export (optimum engine), and the base export
    with ``generate --embeds --lora`` through GenAI (UNet adapter, the text encoders' part in their weights).

    Tolerance: GenAI within 1.5 of the fused export (both OpenVINO). Against PyTorch: 4x the gap the same export
    shows without concept and adapter, measured here (at least 1.0), and under half of what the adapter does. That
    floor is ~0 where OpenVINO's f32 matches PyTorch (measured 0.0 for the fused export forced to f32 on AVX-512
    CPUs), so the bound is 1.0 there; it is not where OpenVINO infers in bf16 (tiny-xl's random weights are
    sensitive to it: on the 2-core Emerald Rapids Xeon 3.2 without, 8.4 with this adapter, whose effect is 22.6;
    GenAI to fused 0.98), nor on a 2-core AMD EPYC with AVX2 only, where OpenVINO reports f32 and still shows 2.78
    without, 8.09 with (the adapter's effect 24.0; GenAI to fused 0.49). Leaving out the adapter's text_encoder_2
    part moves GenAI 11.3 away from the fused export. The concept and the adapter each move the images by more
    than 8."""

    reference = _diffusers(tiny_xl_model, xl_embeds, xl_lora)
    plain = _diffusers(tiny_xl_model, None, None)
    fused = _images(ov_xl_fused, "optimum")
    genai = _images(ov_xl, "genai", embeds=xl_embeds, loras=((xl_lora, 1.0),))
    figures = {
        "fused export (optimum)": float(np.abs(fused - reference).mean()),
        "genai --embeds --lora": float(np.abs(genai - reference).mean()),
        "genai to fused": float(np.abs(genai - fused).mean()),
        "base export, no concept or adapter (optimum)": float(np.abs(_images(ov_xl, "optimum") - plain).mean()),
        "concept and adapter (diffusers)": float(np.abs(plain - reference).mean()),
        "adapter (diffusers)": float(np.abs(_diffusers(tiny_xl_model, xl_embeds, None) - reference).mean()),
    }
    print("\nmean abs pixel difference to diffusers PyTorch:", {k: round(v, 3) for k, v in figures.items()})
    floor = figures["base export, no concept or adapter (optimum)"]
    bound = min(max(1.0, 4 * floor), figures["adapter (diffusers)"] / 2)
    assert figures["fused export (optimum)"] < bound and figures["genai --embeds --lora"] < bound, (bound, figures)
    assert figures["genai to fused"] < 1.5
    assert figures["adapter (diffusers)"] > 8.0 and figures["concept and adapter (diffusers)"] > 8.0


def test_sdxl_refuses_the_other_familys_lora_and_embedding(
    tiny_model: Path, ov_xl: Path, xl_lora: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A LoRA made for SD 1.5 given to an SDXL export, an SDXL LoRA given to an SD 1.5 export, an SD 1.5
    embedding given to SDXL: one line each naming both families, before anything is compiled."""
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from safetensors.torch import save_file

    sd_unet = UNet2DConditionModel.from_pretrained(tiny_model / "unet")
    gen = torch.Generator().manual_seed(1)
    sd_lora = tmp_path / "sd"
    StableDiffusionPipeline.save_lora_weights(sd_lora, unet_lora_layers=_add_lora(sd_unet, ["to_k"], gen, 0.1))
    err = cli_error(["generate", str(ov_xl), "--lora", str(sd_lora / LORA_FILE), "--out", str(tmp_path / "o")], capsys)
    assert "was made for SD 1.x/2.x (it adapts attention in the UNet's first down block)" in err and "is SDXL" in err
    err = cli_error(["export", str(tiny_model), str(tmp_path / "ov"), "--lora", str(xl_lora)], capsys)
    assert "was made for SDXL (it adapts a second text encoder (text_encoder_2))" in err
    assert f"the source {tiny_model} is SD 1.x/2.x" in err
    sd_embeds = tmp_path / "sd.safetensors"
    save_file({"<sd>": torch.zeros(1, 32)}, str(sd_embeds))
    err = cli_error(["generate", str(ov_xl), "--embeds", str(sd_embeds), "--out", str(tmp_path / "o")], capsys)
    assert "an embedding for SD 1.x/2.x (one text encoder), and this model is SDXL" in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "ov").exists()


def test_sdxl_concept_file_round_trip_and_refusals(tmp_path: Path) -> None:
    path = save_xl_concept(tmp_path / "c.safetensors", "<c>", np.ones((2, 768)), np.ones((2, 1280)))
    concepts = load_xl_concept(path)
    assert concepts["text_encoder"].tokens == ["<c>", "<c>_1"] and concepts["text_encoder_2"].hidden_size == 1280
    assert load_xl_concept(path, token="<d>")["text_encoder"].tokens[0] == "<d>"
    with pytest.raises(ConceptError, match="clip_l has 2 vectors and clip_g 1"):
        save_xl_concept(tmp_path / "bad.safetensors", "<c>", np.ones((2, 768)), np.ones((1, 1280)))
    assert not list(tmp_path.glob("*bad*"))
