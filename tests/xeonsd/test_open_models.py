"""The offline FLUX.2-klein, Z-Image and Qwen-Image pipelines (``make-tiny-model --arch tiny-flux2 / tiny-zimage /
tiny-qwenimage``): each loads with its own diffusers pipeline class and makes a 64 px image in 2 steps, and their
Qwen tokenizer knows the tiny words as single tokens and gives Qwen-Image's system prefix its real length."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from xeonsd.assets import make_tiny_model
from xeonsd.assets.models import arch_names
from xeonsd.assets.open_text import QWEN_IMAGE_TEMPLATE

PIPELINES = {"tiny-flux2": "Flux2KleinPipeline", "tiny-zimage": "ZImagePipeline", "tiny-qwenimage": "QwenImagePipeline"}
SIDE = 64  # the tiny archs' default side: latent 8x8, 16 tokens after 2x2 packing


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("open_models")
    return {arch: make_tiny_model(root / arch, arch=arch, seed=0) for arch in PIPELINES}


@pytest.mark.parametrize("arch", sorted(PIPELINES))
def test_tiny_pipeline_generates_an_image_of_the_requested_size(built: dict[str, Path], arch: str) -> None:
    import diffusers

    pipe = getattr(diffusers, PIPELINES[arch]).from_pretrained(built[arch])
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        prompt="a photo of a toy robot",
        height=SIDE,
        width=SIDE,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    )
    image = out.images[0]
    assert image.shape == (SIDE, SIDE, 3)
    assert np.isfinite(image).all()
    assert image.std() > 1e-3, "a random-weight pipeline should not make a constant image"


@pytest.mark.parametrize("arch", sorted(PIPELINES))
def test_tokenizer_round_trips_tiny_words_as_single_tokens(built: dict[str, Path], arch: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built[arch] / "tokenizer")
    prompt = "a photo of a toy robot on the beach"
    ids = tok(prompt, add_special_tokens=False).input_ids
    assert tok.decode(ids) == prompt
    assert len(ids) == len(prompt.split())
    # QwenImagePipeline drops prompt_template_encode_start_idx (34) tokens: the system prefix, with the real vocabulary.
    assert len(tok(QWEN_IMAGE_TEMPLATE.split("{}")[0]).input_ids) == 34
    chat = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert chat == f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_open_archs_are_make_tiny_model_archs() -> None:
    assert {"flux2-klein", "zimage", "qwenimage", *PIPELINES} <= set(arch_names())


def test_depth_is_refused_on_a_tiny_open_arch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--depth applies to"):
        make_tiny_model(tmp_path / "m", arch="tiny-zimage", depth=1)


def test_configs_only_writes_no_weight_and_gives_the_same_training_estimate(
    built: dict[str, Path], tmp_path: Path
) -> None:
    """``make-tiny-model --configs-only`` (for the estimate of a model this machine cannot hold: Qwen-Image's 20 B
    transformer) writes the pipeline's configs and tokenizer and no weight; the trainer's memory estimate of it
    trains with the same terms as the weighted pipeline's. Other archs refuse the flag."""
    from xeonsd.trainer import memory
    from xeonsd.trainer.argv import parse_config

    full = built["tiny-qwenimage"]
    configs = make_tiny_model(tmp_path / "configs", arch="tiny-qwenimage", configs_only=True)
    assert not [p for p in configs.rglob("*") if p.suffix in (".safetensors", ".bin")]
    names = {str(p.relative_to(full)) for p in full.rglob("*.json")}
    assert names == {str(p.relative_to(configs)) for p in configs.rglob("*.json")}, names

    def estimate(src: Path) -> tuple[int, ...]:
        argv = [f"--pretrained_model_name_or_path={src}", "--train_data_dir=unused", "--output_dir=unused"]
        cfg = parse_config([*argv, "--method=lora", "--resolution=64", "--train_batch_size=1"])
        e = memory.estimate(cfg, "lora", 5, 1)
        return e.weights, e.gradients, e.optimizer, e.activations, e.caches

    assert estimate(configs) == estimate(full) and estimate(full)[3] > 0
    with pytest.raises(ValueError, match="--configs-only is for"):
        make_tiny_model(tmp_path / "sd", arch="tiny", configs_only=True)


def test_a_cut_flux2_dev_takes_a_thin_encoder_of_the_real_context_width(tmp_path: Path) -> None:
    """``--arch flux2-dev --depth D``: the real widths at D double-stream blocks and 6D single-stream ones, and in
    place of the 24 B Mistral (48 GB, no test machine holds it) a thin one that still has its 5120-wide hidden
    states at the stacked layers 10, 20 and 30, so the transformer's context is the real 3 x 5120."""
    import json

    out = make_tiny_model(tmp_path / "dev", arch="flux2-dev", depth=1, configs_only=True)
    transformer = json.loads((out / "transformer" / "config.json").read_text())
    text = json.loads((out / "text_encoder" / "config.json").read_text())["text_config"]
    assert (transformer["num_layers"], transformer["num_single_layers"]) == (1, 6)
    assert transformer["num_attention_heads"] * transformer["attention_head_dim"] == 6144
    assert text["hidden_size"] == 5120 and text["num_hidden_layers"] >= 30
    assert transformer["joint_attention_dim"] == 3 * text["hidden_size"]
    per_layer = (
        text["hidden_size"] * text["head_dim"] * (2 * text["num_attention_heads"] + 2 * text["num_key_value_heads"])
        + 3 * text["hidden_size"] * text["intermediate_size"]
    )
    assert per_layer * text["num_hidden_layers"] < 2e9  # the real one: 40 layers of 0.55 B
