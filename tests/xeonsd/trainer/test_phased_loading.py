"""Phased loading (``--phased_loading``, the default): the text encoders and the VAE first, the prompts encoded and
the latents cached, a flow family's T5 freed, and only then the denoiser. It changes when the models load, never
what the run learns; and the estimate's loading phase is the larger phase's."""

from __future__ import annotations

import json

import torch
from cli_runs import method_args, train
from safetensors.torch import load_file
from test_methods import LORA_FILE

FLAGS = ("--instance_prompt=a photo of sks toy", "--validation_split=0.25", "--validation_steps=2")


def sd3_args(model, data, out, *extra: str) -> list[str]:
    args = method_args("lora", model, data, out, *FLAGS, *extra, steps=2)
    return [a for a in args if not a.startswith("--resolution")]  # the tiny flow model's own


def test_the_denoiser_loaded_last_learns_bit_for_bit_what_loading_everything_learns(
    tiny_sd3_model, dataset, tmp_path, cli_env
):
    """2 ranks of SD3 LoRA (T5 freed before the transformer loads; shared weights; a validation loss)."""
    phased, whole = tmp_path / "phased", tmp_path / "whole"
    first = train(sd3_args(tiny_sd3_model, dataset, phased), cli_env, ranks=2)
    second = train(sd3_args(tiny_sd3_model, dataset, whole, "--no-phased_loading"), cli_env, ranks=2)
    assert "the denoiser loaded in" in first.stderr and "the denoiser loaded in" not in second.stderr
    # the CLIP encoders load once T5 is freed, never beside it
    freed, clip = first.stderr.find("T5EncoderModel freed"), first.stderr.find("after the long text encoder was freed")
    assert 0 <= freed < clip and "after the long text encoder was freed" not in second.stderr
    a, b = load_file(str(phased / LORA_FILE)), load_file(str(whole / LORA_FILE))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(v.abs().max() > 0 for k, v in a.items() if "lora_B" in k), "nothing learned"
    startup = json.loads((phased / "train_summary.json").read_text())["startup"]
    mapped, held = startup["shared_weights_bytes"], startup["shared_weights_held_bytes"]
    assert "text_encoder_3" in mapped and "text_encoder_3" not in held  # T5 released before training
    assert "transformer" in held and held.items() <= mapped.items()


def test_the_estimate_s_loading_phase_is_the_larger_phase_s(tiny_sd3_model):
    """Loading every model at once adds the transformer to T5 and the VAE; in phases T5 is gone when it loads."""
    from xeonsd.trainer.argv import parse_config
    from xeonsd.trainer.memory import estimate

    args = [f"--pretrained_model_name_or_path={tiny_sd3_model}", "--method=lora", "--train_data_dir=/x"]
    args += ["--output_dir=/x", "--instance_prompt=a toy"]
    phased = estimate(parse_config(args), "lora", 5, 1)
    whole = estimate(parse_config([*args, "--no-phased_loading"]), "lora", 5, 1)
    assert phased.loading - phased.runtime < whole.loading - whole.runtime
    from xeonsd.trainer.memory.measure import in_phases

    # in phases the text encoders' phase is the larger of T5's (10 - 4 = 6 of the 10) and the CLIP ones'
    parts = ((10, 10), (2, 2), (3, 3, 1))
    assert in_phases(parse_config(args), "lora", *parts, apart=4) == (6, 6, 0)
    assert in_phases(parse_config([*args, "--no-phased_loading"]), "lora", *parts, apart=4) == (13, 13, 1)
    # with the text encoder trained the prompts need the method first: no phases
    trained = [*args, "--train_text_encoder"]
    on, off = (
        estimate(parse_config(trained), "lora", 5, 1),
        estimate(parse_config([*trained, "--no-phased_loading"]), "lora", 5, 1),
    )
    assert on.loading - on.runtime == off.loading - off.runtime
