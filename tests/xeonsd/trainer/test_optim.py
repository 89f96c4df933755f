"""The optimizer the trainer builds: AdamW's fused CPU kernel by default, torch's per-tensor loop on request."""

from __future__ import annotations

import torch

from xeonsd.trainer.config import parse_config
from xeonsd.trainer.optim import make_optimizer


class _Method:
    def __init__(self) -> None:
        self.params = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5))]

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.params


def _optimizer(*flags: str) -> torch.optim.Optimizer:
    argv = ["--pretrained_model_name_or_path=m", "--train_data_dir=d", "--method=lora", *flags]
    return make_optimizer(parse_config(argv), _Method(), world=1)[0]


def test_adamw_is_fused_by_default_and_the_loop_is_one_flag_away():
    fused = _optimizer()
    assert isinstance(fused, torch.optim.AdamW) and fused.defaults["fused"] is True
    loop = _optimizer("--no-fused_adamw")
    assert not loop.defaults["fused"] and not loop.defaults["foreach"]
    for opt in (fused, loop):  # both update the same way
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        opt.step()
    for a, b in zip(fused.param_groups[0]["params"], loop.param_groups[0]["params"], strict=True):
        torch.testing.assert_close(a, b)
        assert a.abs().sum() > 0
