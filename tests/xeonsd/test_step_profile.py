"""The per-class profile of a training step (xeonsd.step_profile): known ops land in their class, and a real
profiled step of the tiny UNet splits into classes that add up to it, with every counted FLOP in a matmul-like
class."""

from __future__ import annotations

import time

import pytest
import torch

from xeonsd import step_profile as sp


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("aten::_scaled_dot_product_flash_attention_for_cpu", sp.ATTN_FWD),
        ("aten::scaled_dot_product_attention", sp.ATTN_FWD),
        ("aten._scaled_dot_product_flash_attention_for_cpu.default", sp.ATTN_FWD),
        ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", sp.ATTN_BWD),
        ("autograd::engine::evaluate_function: ScaledDotProductFlashAttentionForCpuBackward0", sp.ATTN_BWD),
        ("aten::conv2d", sp.CONV),
        ("aten::mkldnn_convolution", sp.CONV),
        ("aten.convolution_backward", sp.CONV),
        ("autograd::engine::evaluate_function: ConvolutionBackward0", sp.CONV),
        ("aten::addmm", sp.MATMUL),
        ("aten.mm", sp.MATMUL),
        ("aten::linear", sp.MATMUL),
        ("aten::bmm", sp.MATMUL),
        ("autograd::engine::evaluate_function: AddmmBackward0", sp.MATMUL),
        ("MmBackward0", sp.MATMUL),
        ("aten::native_group_norm", sp.ELEMENTWISE),
        ("aten::native_layer_norm_backward", sp.ELEMENTWISE),
        ("NativeGroupNormBackward0", sp.ELEMENTWISE),
        ("aten::silu", sp.ELEMENTWISE),
        ("aten::add_", sp.ELEMENTWISE),
        ("aten::_to_copy", sp.ELEMENTWISE),
        ("aten::_foreach_lerp_", sp.ELEMENTWISE),
        ("MulBackward0", sp.ELEMENTWISE),
        ("Optimizer.step#AdamW.step", sp.OPTIMIZER),
        ("Optimizer.zero_grad#AdamW.zero_grad", sp.OPTIMIZER),
        ("aten::empty", None),
        ("aten::view", None),
        ("aten::_convert_indices_from_coo_to_csr", None),
        ("ProfilerStep#1", None),
    ],
)
def test_classify_op_puts_known_ops_in_their_class(name, cls):
    assert sp.classify_op(name) == cls


def test_class_of_takes_the_nearest_classified_range_and_the_optimizer_encloses_all():
    assert sp.class_of(["aten::empty", "aten::mkldnn_convolution", "aten::conv2d", "step"]) == sp.CONV
    assert sp.class_of(["aten::to", "aten::conv2d"]) == sp.ELEMENTWISE  # a cast is its own work
    assert sp.class_of(["aten::mul_", "aten::_foreach_mul_", "Optimizer.step#AdamW.step"]) == sp.OPTIMIZER
    assert sp.class_of(["aten::empty", "aten::view"]) == sp.OTHER


def test_a_profiled_tiny_step_adds_up_and_its_flops_are_matmul_like(tiny_model):
    from diffusers import UNet2DConditionModel
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    from xeonsd.flops import count_cpu_ops

    unet = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet")
    unet.requires_grad_(False)
    params = [p for n, p in unet.named_parameters() if "attn" in n]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=1e-3)
    cfg = unet.config
    x = torch.randn(1, cfg.in_channels, cfg.sample_size, cfg.sample_size)
    text = torch.randn(1, 77, cfg.cross_attention_dim)

    def step():
        unet(x, 10, text).sample.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    count_cpu_ops()
    with FlopCounterMode(display=False) as counter:
        step()
    step()  # warm: the profiled steps are steady ones (a tiny step's 18 ms swing with first calls and load)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        wall = time.perf_counter() - t0
    seconds = sp.seconds_by_class(prof.events(), wall)
    in_ops = sum(ev.self_cpu_time_total for ev in prof.events()) / 1e6
    assert set(seconds) == set(sp.CLASSES)
    assert sum(v for k, v in seconds.items() if k != sp.OUTSIDE) == pytest.approx(in_ops, rel=1e-9)
    assert sum(seconds.values()) == pytest.approx(max(wall, in_ops), rel=1e-9)
    assert in_ops <= wall * 1.05  # self times: nothing counted twice
    for cls in (sp.ATTN_FWD, sp.ATTN_BWD, sp.CONV, sp.MATMUL, sp.ELEMENTWISE, sp.OPTIMIZER):
        assert seconds[cls] > 0, (cls, seconds)
    assert seconds[sp.OTHER] < 0.25 * in_ops, seconds  # the classes name most of the step
    flops = sp.flops_by_class(counter.get_flop_counts()["Global"])
    assert sum(flops.values()) == counter.get_total_flops()
    assert sum(flops[c] for c in sp.MATMUL_LIKE) == counter.get_total_flops()
    assert all(flops[c] > 0 for c in sp.MATMUL_LIKE), flops
    rows = sp.class_rows(seconds, {k: v / 1e12 for k, v in flops.items()}, peak_tflops=1.0)
    assert [r["class"] for r in rows] == list(sp.CLASSES)
    assert sum(r["of_step"] for r in rows) == pytest.approx(1.0)
    assert all((r["of_peak"] is None) == (r["class"] not in sp.MATMUL_LIKE) for r in rows)
