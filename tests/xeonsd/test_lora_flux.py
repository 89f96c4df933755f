"""FLUX.1 LoRA files in kohya's layout (``--save_format kohya``, what ComfyUI and Forge load): written from the
diffusers layout our trainer and diffusers save, read back by diffusers' own kohya loader and by ours with the same
weight deltas; SD3 has no kohya layout and says so. No OpenVINO here: the layouts alone, on tiny-flux."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from xeonsd.families import by_name
from xeonsd.modelfiles import lora_layout
from xeonsd.modelfiles.lora_layout import LoraFormatError, read_adapter

LORA_FILE = "pytorch_lora_weights.safetensors"
# diffusers' and GenAI's kohya FLUX loaders split a single block's linear1 at FLUX.1's widths (3072 x 3 + 12288), so
# the round trip through diffusers adapts every other kind of transformer layer; linear1 is checked on our reader.
DOUBLE = [
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.0.attn.to_k",
    "transformer_blocks.0.attn.to_v",
    "transformer_blocks.0.attn.to_out.0",
    "transformer_blocks.0.attn.add_q_proj",
    "transformer_blocks.0.attn.add_v_proj",
    "transformer_blocks.0.attn.to_add_out",
    "transformer_blocks.0.ff.net.0.proj",
    "transformer_blocks.0.norm1_context.linear",
    "single_transformer_blocks.0.proj_out",
    "x_embedder",
]


def _peft_lora(model, targets: list[str], seed: int, rank: int = 2, alpha: int = 4) -> None:
    """A peft LoRA on ``model``'s ``targets`` with random up matrices."""
    from peft import LoraConfig

    gen = torch.Generator().manual_seed(seed)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module")
def flux_parts(tiny_flux_model: Path):
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextModel

    return (
        FluxTransformer2DModel.from_pretrained(tiny_flux_model / "transformer"),
        CLIPTextModel.from_pretrained(tiny_flux_model / "text_encoder"),
    )


def _save(out: Path, transformer, text_encoder=None) -> Path:
    """The adapters on ``transformer`` (and ``text_encoder``) saved as diffusers saves them, with their alphas in
    the metadata."""
    from diffusers import FluxPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    extra = {}
    if text_encoder is not None:
        extra["text_encoder_lora_layers"] = convert_state_dict_to_diffusers(get_peft_model_state_dict(text_encoder))
        extra["text_encoder_lora_adapter_metadata"] = text_encoder.peft_config["default"].to_dict()
    FluxPipeline.save_lora_weights(
        out,
        transformer_lora_layers=get_peft_model_state_dict(transformer),
        transformer_lora_adapter_metadata=transformer.peft_config["default"].to_dict(),
        safe_serialization=True,
        **extra,
    )
    return out / LORA_FILE


def _deltas(modules: dict[str, lora_layout.LoraModule]) -> dict[str, np.ndarray]:
    """in-memory (kohya) name -> the weight delta scale x up @ down."""
    return {m.name: m.scale * (m.up.astype(np.float64) @ m.down.astype(np.float64)) for m in modules.values()}


def test_flux_kohya_layout_loads_in_diffusers_with_the_same_deltas(flux_parts, tmp_path: Path) -> None:
    """The diffusers file (transformer + CLIP-L, alpha 4 over rank 2) -> ``convert(..., "kohya", family=FLUX.1)``:
    BFL names with query/key/value fused, CLIP-L as ``lora_te1_``; diffusers' ``lora_state_dict`` reads it back to
    the same per-module deltas (its loader folds the alphas into the matrices)."""
    from diffusers import FluxPipeline
    from safetensors import safe_open

    transformer, clip = flux_parts
    _peft_lora(transformer, DOUBLE, 0)
    _peft_lora(clip, ["q_proj", "out_proj"], 1)
    src = _save(tmp_path / "d", transformer, clip)
    assert {m.scale for m in read_adapter(src).values()} == {2.0}  # alpha 4 over rank 2, from the metadata
    kohya = lora_layout.convert(src, tmp_path / "k" / LORA_FILE, "kohya", family=by_name("flux"))
    with safe_open(str(kohya), framework="numpy") as fh:
        keys = set(fh.keys())
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in keys
    assert "lora_unet_double_blocks_0_txt_attn_qkv.alpha" in keys and "lora_unet_img_in.lora_up.weight" in keys
    assert "lora_unet_single_blocks_0_linear2.lora_up.weight" in keys
    assert any(k.startswith("lora_te1_text_model_encoder_layers_0_self_attn_q_proj") for k in keys)
    assert not any(k.startswith(("transformer.", "lora_transformer_", "lora_te_")) for k in keys)

    want = _deltas(read_adapter(src))
    state = FluxPipeline.lora_state_dict(str(kohya.parent), weight_name=kohya.name)
    state = state[0] if isinstance(state, tuple) else state
    got: dict[str, np.ndarray] = {}
    for key, down in state.items():
        if ".lora_A." in key and not key.startswith("text_encoder."):  # its img_in: x_embedder, no prefix
            up = state[key.replace(".lora_A.", ".lora_B.")]
            module = key.split(".lora_A.")[0].removeprefix("transformer.")
            got[lora_layout.kohya_name("transformer", module)] = up.double().numpy() @ down.double().numpy()
    for name, delta in want.items():
        if name.startswith("lora_transformer_"):
            np.testing.assert_allclose(got.pop(name), delta, rtol=1e-5, atol=1e-6, err_msg=name)
    assert list(got) == ["lora_transformer_transformer_blocks_0_attn_add_k_proj"]  # the fused layer's other part
    assert not got["lora_transformer_transformer_blocks_0_attn_add_k_proj"].any()
    back = _deltas(read_adapter(kohya))  # CLIP-L's part, through our reader (lora_te1_ -> the text encoder)
    assert any(name.startswith("lora_te_") for name in want)
    for name, delta in want.items():
        if name.startswith("lora_te_"):
            np.testing.assert_allclose(back[name], delta, rtol=1e-5, atol=1e-6, err_msg=name)


def test_flux_kohya_fuses_single_block_linear1_and_reads_back(flux_parts, tmp_path: Path) -> None:
    """A single block's query/key/value (diffusers' default FLUX targets reach them) fuse into ``linear1`` with zero
    rows for its MLP part; our reader splits it back to the same deltas, and refuses a layer FLUX.1 does not have."""
    from diffusers import FluxTransformer2DModel

    fresh = FluxTransformer2DModel.from_config(flux_parts[0].config)
    _peft_lora(fresh, ["attn.to_q", "attn.to_k", "attn.to_v"], 2)
    src = _save(tmp_path / "d", fresh)
    kohya = lora_layout.convert(src, tmp_path / "k" / LORA_FILE, "kohya", family=by_name("flux"))
    want, back = _deltas(read_adapter(src)), _deltas(read_adapter(kohya))
    inner = fresh.config.num_attention_heads * fresh.config.attention_head_dim
    linear1 = read_adapter(kohya)["lora_transformer_single_transformer_blocks_0_proj_mlp"]
    assert linear1.up.shape == (4 * inner, 6) and not linear1.up.any()  # the MLP part: zero rows
    del back["lora_transformer_single_transformer_blocks_0_proj_mlp"]
    assert set(back) == set(want)
    for module, delta in want.items():
        np.testing.assert_allclose(back[module], delta, rtol=1e-5, atol=1e-6, err_msg=module)

    from safetensors.numpy import save_file

    bad = tmp_path / "bad.safetensors"
    save_file(
        {
            f"lora_unet_double_blocks_0_img_attn_nope.{p}": np.ones((2, 2), np.float32)
            for p in ("lora_down.weight", "lora_up.weight")
        },
        str(bad),
    )
    with pytest.raises(
        LoraFormatError, match="lora_unet_double_blocks_0_img_attn_nope is not a module of FLUX.1's kohya layout"
    ):
        read_adapter(bad)


def test_sd3_has_no_kohya_layout(tmp_path: Path) -> None:
    with pytest.raises(LoraFormatError, match="SD3/SD3.5 has no kohya layout; ComfyUI and Forge load its adapters"):
        lora_layout.write_kohya_for(by_name("sd3"))
