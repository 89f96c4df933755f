"""``--fsdp``: a full fine-tune sharded over the ranks with PyTorch's FSDP2, under real mpirun on the tiny model:
it learns what one unsharded rank learns, its checkpoints resume on another number of ranks without sharding, and
the estimate per rank follows the sharding."""

from __future__ import annotations

import json
import re
import shutil

import torch
from cli_runs import method_args, refused, train
from test_methods import assert_same_training, unet_weights

# The same run four ways: every feature whose calls must stay in step across the ranks of a sharded UNet (the EMA,
# the clipped norm, two micro-batches per step, the validation loss on one held-out image that only rank 0 has, the
# validation images rank 0 renders, the checkpoints), in fp32 so that only the order of float additions differs.
FLAGS = (
    "--instance_prompt=a photo of toy",
    "--mixed_precision=no",
    "--use_ema",
    "--ema_decay=0.5",
    "--max_grad_norm=0.5",
    "--gradient_accumulation_steps=2",
    "--validation_split=0.2",
    "--validation_prompt=a photo of toy",
    "--num_validation_images=1",
    "--validation_steps=2",
    "--checkpointing_steps=2",
)


def val_losses(out) -> dict[int, float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}


def test_two_sharded_ranks_learn_what_one_rank_learns_and_resume_on_one(tiny_model, dataset, tmp_path, cli_env):
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    train(method_args("full", tiny_model, dataset, one, *FLAGS, batch=2, steps=4), cli_env)
    proc = train(method_args("full", tiny_model, dataset, two, *FLAGS, "--fsdp", steps=4), cli_env, ranks=2)
    assert "sharded over 2 ranks" in proc.stderr, proc.stderr[-3000:]
    # the node's two ranks mapped one whole copy of the UNet, kept their shards and let go of it at once
    assert re.search(r"shared by the node's ranks: .*unet \d", proc.stderr), proc.stderr[-3000:]
    assert re.search(r"removed \S+/unet\.weights: no rank of the node maps it", proc.stderr), proc.stderr[-3000:]
    base = unet_weights(tiny_model)
    # FSDP's reduce-scatter adds the gradients in another order than one rank's backward: on a 2-core Zen 4 one
    # element with a near-zero gradient moved 5.7 % of the largest update (the mean stays under 1e-4 of the mean)
    assert_same_training(unet_weights(one), unet_weights(two), base, largest=0.1)
    rows = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    n_unet = sum(v.numel() for v in base.values())
    assert rows[0]["allreduce_bytes"] == (3 * n_unet + 1) * 4  # two all-gathers of the weights, one reduce-scatter
    val = val_losses(two)
    assert val.keys() == {2, 4} and all(abs(val[s] - val_losses(one)[s]) < 1e-4 for s in val)
    assert sorted(p.name for p in (two / "validation").iterdir()) == ["final", "step-2", "step-4"]
    # the sharded run's step-2 checkpoint, resumed by one unsharded rank with the same global batch
    resumed.mkdir()
    shutil.copytree(two / "checkpoint-2", resumed / "checkpoint-2")
    args = method_args(
        "full", tiny_model, dataset, resumed, *FLAGS, "--resume_from_checkpoint=latest", batch=2, steps=4
    )
    proc = train(args, cli_env)
    assert "resumed from" in proc.stderr and "global batch" not in proc.stderr
    assert_same_training(unet_weights(one), unet_weights(resumed), base, largest=0.1)
    state = torch.load(two / "checkpoint-4" / "trainer_state.pt", weights_only=False)
    assert state["method_state"]["unet"].keys() == base.keys()  # whole weights by name, not this rank's shards
    assert all(isinstance(k, str) for k in state["optimizer"]["state"])


def test_the_estimate_per_rank_shards_what_trains(tiny_model):
    """Over 4 ranks the trained weights, their gradients and AdamW's moments take a quarter (plus the blocks being
    gathered); the frozen parts do not change. While loading, each rank holds its shards beside the whole UNet, which
    the node's ranks map once."""
    from xeonsd.trainer.argv import parse_config
    from xeonsd.trainer.memory import estimate

    args = [
        f"--pretrained_model_name_or_path={tiny_model}",
        "--method=full",
        "--resolution=64",
        "--train_data_dir=/x",
        "--output_dir=/x",
    ]
    plain = estimate(parse_config(args), "full", 5, 1, world=4)
    sharded = estimate(parse_config([*args, "--fsdp"]), "full", 5, 1, world=4)
    alone = estimate(parse_config([*args, "--fsdp"]), "full", 5, 1, world=1)
    trained = ("weights", "gradients", "optimizer")  # (the runtime term is this process's own size: it varies)
    assert [getattr(alone, t) for t in trained] == [getattr(plain, t) for t in trained]
    assert sharded.optimizer * 4 == plain.optimizer
    assert plain.gradients // 4 < sharded.gradients < plain.gradients  # (the tiny UNet: few, large blocks)
    assert plain.weights - plain.gradients < sharded.weights < plain.weights
    assert (sharded.activations, sharded.caches) == (plain.activations, plain.caches)
    own = plain.gradients  # the fp32 UNet's bytes
    assert abs((sharded.loading - sharded.runtime) - (plain.loading - plain.runtime) - own // 4) < 1e6
    assert sharded.shared_loading - plain.shared_loading == own


def test_a_layout_fsdp_cannot_shard_is_refused_before_loading(tiny_model, dataset, tmp_path, cli_env):
    err = refused(method_args("full", tiny_model, dataset, tmp_path / "o", "--fsdp", "--channels_last"), cli_env)
    assert "--fsdp cannot shard a UNet with --channels_last" in err
    assert not (tmp_path / "o").exists()
