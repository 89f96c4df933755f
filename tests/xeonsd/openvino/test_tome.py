"""``xeonsd export --tome RATIO`` on the tiny model: the merge itself, where it applies, its place in the exported
graph, both engines, hybrid int8 on top, ratio 0 as today's export, and the ratios refused.

The tiny UNet has transformer blocks at the 8x8 latent level of a 64 px image (64 tokens) and in the mid block
(4x4 = 16 tokens): ToMe must merge in the first and leave the second alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
import torch
from ov_assets import BATCH, PROMPT, SIZE, STEPS, as_array, linear_weight_types

from xeonsd import cli
from xeonsd.openvino import tome
from xeonsd.openvino.manifest import MANIFEST

RATIO = 0.5
LATENT = SIZE // 8
TOKENS = LATENT * LATENT
MERGED = TOKENS - int(RATIO * TOKENS)


def _export_cli(src: Path, out: Path, *flags: str) -> Path:
    argv = ["export", str(src), str(out), "--batch-size", str(BATCH), "--height", str(SIZE), "--width", str(SIZE)]
    assert cli.main([*argv, *flags]) == 0
    return out


@pytest.fixture(scope="module")
def ov_tome(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _export_cli(tiny_model, tmp_path_factory.mktemp("tome") / "ov", "--tome", str(RATIO))


def _unet_inputs(batch: int = 2) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "sample": torch.randn(batch, 4, LATENT, LATENT, generator=gen),
        "timestep": torch.tensor([10]),
        "encoder_hidden_states": torch.randn(batch, 77, 32, generator=gen),
    }


def _self_attention_tokens(unet: torch.nn.Module, inputs: dict) -> dict[str, int]:
    """Tokens each transformer block's self-attention computed on (its query projection's input), in one forward."""
    seen: dict[str, int] = {}
    hooks = [
        m.attn1.to_q.register_forward_hook(lambda mod, args, out, n=n: seen.__setitem__(n, args[0].shape[1]))
        for n, m in unet.named_modules()
        if type(m).__name__ == "BasicTransformerBlock"
    ]
    with torch.no_grad():
        unet(**inputs)
    for h in hooks:
        h.remove()
    return seen


def test_merge_removes_duplicates_and_unmerge_restores_them_exactly() -> None:
    """Every source a copy of a destination: all of them merge away (ratio 0.75) and unmerge gives x back."""
    dst, src = tome.partition(LATENT, LATENT)
    windows = {(int(i) // LATENT // 2, int(i) % LATENT // 2) for i in dst}
    assert len(dst) == len(windows) == TOKENS // 4 and len(src) == TOKENS - len(dst)  # one per 2x2 window
    assert torch.equal(torch.cat([dst, src]).sort().values, torch.arange(TOKENS))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, TOKENS, 8, generator=gen)
    x[:, src] = x[:, dst[torch.randint(len(dst), (len(src),), generator=gen)]]
    merge, unmerge = tome.bipartite_matching(x, dst, src, int(0.75 * TOKENS))
    merged = merge(x)
    assert merged.shape == (2, len(dst), 8)
    torch.testing.assert_close(unmerge(merged), x)
    # Half the ratio: the kept tokens come back unchanged, the output keeps its shape.
    merge, unmerge = tome.bipartite_matching(torch.randn(2, TOKENS, 8), dst, src, TOKENS // 2)
    assert merge(x).shape == (2, TOKENS // 2, 8) and unmerge(merge(x)).shape == x.shape


def test_apply_merges_only_the_largest_blocks_at_the_ratio(tiny_model: Path) -> None:
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(tiny_model / "unet").eval()
    inputs = _unet_inputs()
    before = _self_attention_tokens(unet, inputs)
    with torch.no_grad():
        plain = unet(**inputs).sample
    assert sorted(set(before.values())) == [TOKENS // 4, TOKENS]  # the mid block and the 8x8 level
    report = tome.apply(unet, inputs, RATIO)
    after = _self_attention_tokens(unet, inputs)
    largest = {n for n, t in before.items() if t == TOKENS}
    assert {b.name for b in report.blocks} == largest
    assert {n: after[n] for n in largest} == dict.fromkeys(largest, MERGED)
    assert all(after[n] == before[n] for n in before if n not in largest)
    with torch.no_grad():
        merged = unet(**inputs).sample
    assert merged.shape == plain.shape and 0 < (merged - plain).abs().mean() < plain.abs().mean()
    assert tome.apply(UNet2DConditionModel.from_pretrained(tiny_model / "unet"), inputs, 0).blocks == []


def _attention_shapes(ov_dir: Path) -> set[tuple[int, int]]:
    """(query tokens, key tokens) of every attention in the exported UNet."""
    model = ov.Core().read_model(ov_dir / "unet" / "openvino_model.xml")
    return {
        (op.input(0).get_partial_shape()[2].get_length(), op.input(1).get_partial_shape()[2].get_length())
        for op in model.get_ops()
        if op.get_type_name() == "ScaledDotProductAttention"
    }


def test_export_runs_self_attention_on_the_merged_tokens(ov_tome: Path, ov_base: Path) -> None:
    small = TOKENS // 4
    assert _attention_shapes(ov_base) == {(TOKENS, TOKENS), (TOKENS, 77), (small, small), (small, 77)}
    # Cross-attention keeps its queries (merging is for self-attention); the mid block is untouched.
    assert _attention_shapes(ov_tome) == {(MERGED, MERGED), (TOKENS, 77), (small, small), (small, 77)}
    entry = json.loads((ov_tome / MANIFEST).read_text())["tome"]
    assert entry["ratio"] == RATIO and entry["mlp"] is False
    assert {(b["tokens"], b["merged_tokens"]) for b in entry["blocks"]} == {(TOKENS, MERGED)}
    assert json.loads((ov_base / MANIFEST).read_text())["tome"] is None
    # The module tree is unchanged: the IR's weights keep the names GenAI's LoRA adapters are matched against.
    from xeonsd.openvino.lora_files import ir_weight_shapes

    assert ir_weight_shapes(ov_tome) == ir_weight_shapes(ov_base) != {}


def _images(ov_dir: Path, engine: str) -> np.ndarray:
    from xeonsd.openvino.generate import GenerateOptions, generate

    opts = GenerateOptions(prompts=(PROMPT,), num_images=BATCH, steps=STEPS, seed=11, engine=engine)
    return as_array(generate(ov_dir, opts)[0])


def test_export_generates_in_both_engines_close_to_the_plain_export(ov_tome: Path, ov_base: Path) -> None:
    optimum, genai = _images(ov_tome, "optimum"), _images(ov_tome, "genai")
    assert optimum.shape == (BATCH, SIZE, SIZE, 3) and optimum.std() > 5.0
    assert np.abs(genai - optimum).mean() < 2.0
    plain = _images(ov_base, "optimum")
    diff = np.abs(optimum - plain).mean()
    assert 0.0 < diff < 0.5 * np.abs(plain - plain.mean()).mean(), diff  # changed, but the same pictures


def test_tome_0_is_exactly_todays_export(tiny_model: Path, ov_base: Path, tmp_path: Path) -> None:
    """Same graph (every operation and shape; the IR text itself differs between any two exports) and weights,
    and the same images bit for bit."""
    out = _export_cli(tiny_model, tmp_path / "ov", "--tome", "0")
    assert json.loads((out / MANIFEST).read_text())["tome"] is None

    def graph(ov_dir: Path) -> list[tuple]:
        model = ov.Core().read_model(ov_dir / "unet" / "openvino_model.xml")
        return [
            (op.get_type_name(), [str(o.get_partial_shape()) for o in op.outputs()]) for op in model.get_ordered_ops()
        ]

    assert graph(out) == graph(ov_base)
    assert (out / "unet" / "openvino_model.bin").read_bytes() == (ov_base / "unet" / "openvino_model.bin").read_bytes()
    assert np.array_equal(_images(out, "optimum"), _images(ov_base, "optimum"))


def test_tome_combines_with_hybrid_compact_int8(tiny_model: Path, ov_base: Path, tmp_path: Path) -> None:
    # hybrid itself (with the UNet's linear layers as exported) is tested in test_quantize.py: here the compact one.
    argv = ["--tome", str(RATIO), "--quantize", "hybrid-compact", "--calibration-samples", "4"]
    out = _export_cli(tiny_model, tmp_path / "ov", *argv)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["tome"]["ratio"] == RATIO and manifest["quantization"]["method"] == "hybrid-compact"
    assert manifest["quantization"]["weights"] == "int8 (every network)"
    assert linear_weight_types(out) & {"i8", "u8"}  # the linear layers' weights compressed too
    assert (MERGED, MERGED) in _attention_shapes(out)
    optimum, genai = _images(out, "optimum"), _images(out, "genai")
    assert np.abs(genai - optimum).mean() < 3.0 and optimum.std() > 5.0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tome", "0.8"], "--tome must be between 0 and 0.75 (the share of tokens merged), got '0.8'"),
        (["--tome", "-0.1"], "--tome must be between 0 and 0.75"),
        (["--tome", "nan"], "--tome must be between 0 and 0.75"),
        (["--tome", "half"], "--tome must be a number between 0 and 0.75, got 'half'"),
        (["--tome", "0.5", "--dynamic"], "--tome needs a static export"),
        (["--tome-mlp"], "--tome-mlp needs --tome RATIO above 0"),
    ],
)
def test_bad_ratios_are_refused_before_any_work(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert cli.main(["export", str(tiny_model), str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xeonsd export: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
