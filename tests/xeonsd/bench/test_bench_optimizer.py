"""``xeonsd bench optimizer``: the LoRA set is the trainer's own adapter count, and the table has both updates."""

from __future__ import annotations

import torch

from xeonsd.bench.optimizer import lora_shapes, main


def test_the_lora_set_has_the_sd15_rank4_adapters_the_trainer_trains():
    # `xeonsd train --method lora` on the SD 1.5 architecture logs "lora: 797184 trainable parameters".
    assert sum(torch.Size(s).numel() for s in lora_shapes()) == 797_184 and len(lora_shapes()) == 256


def test_bench_optimizer_prints_both_implementations_per_set(capsys):
    assert main(["--rounds=1", "--updates=1", "--full-m=0.2"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0], r[-4]) for r in rows] == [("lora", "loop"), ("lora", "fused"), ("full", "loop"), ("full", "fused")]
    assert all(float(r[-3]) > 0 for r in rows) and [float(r[-2]) for r in rows][1::2] == [1.0, 1.0]
    assert main(["--rounds=0"]) == 2
