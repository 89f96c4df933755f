"""The optimizer the trainer builds (AdamW's fused CPU kernel by default, torch's per-tensor loop on request), and
the bounds of --profile_step."""

from __future__ import annotations

import pytest
import torch

from xeonsd.cluster.launch import RankInfo
from xeonsd.trainer.argv import parse_config
from xeonsd.trainer.config import ConfigError
from xeonsd.trainer.inputs import check_flags
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


def test_a_profile_step_outside_the_run_is_refused_naming_the_flag():
    base = ["--pretrained_model_name_or_path=m", "--train_data_dir=d", "--max_train_steps=3"]
    for bad in ("-1", "4"):
        with pytest.raises(
            ConfigError, match=rf"--profile_step must be 0 \(off\) or a step of the run \(1-3\), got {bad}"
        ):
            check_flags(parse_config([*base, f"--profile_step={bad}"]), RankInfo(0, 1, 0, 1, "single"))
    check_flags(parse_config([*base, "--profile_step=3"]), RankInfo(0, 1, 0, 1, "single"))
