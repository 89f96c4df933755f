"""``--adapter dora|lokr|loha`` beside plain LoRA (xeonsd.trainer.methods.adapters), on the tiny SD pipeline (a UNet)
and the tiny FLUX.1 pipeline (a flow transformer), under real mpirun; the runs are shared by the tests (one
module-scoped cache):

* each adapter type trains, and its file loads back onto the stock pipeline the way docs/trainer.md says (DoRA:
  diffusers' ``load_lora_weights``, magnitude vectors included; LoKr and LoHa: ``PeftModel.from_pretrained`` on the
  denoiser) with the trained weights, and changes what the pipeline generates;
* LoKr: 2 ranks x batch 1 learn what 1 rank x batch 2 learns, and resuming the 2-rank run's step-2 checkpoint on
  1 rank ends where the uninterrupted run ends;
* what cannot work is refused in one line naming the option and the fix, and xeonsd's LoRA readers (GenAI
  applies plain LoRA) refuse each other type by name.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from cli_runs import method_args, train
from safetensors.torch import load_file
from test_methods import LORA_FILE, assert_same_training

from xeonsd.contracts.method_names import COMFYUI_FILE
from xeonsd.modelfiles.lora_comfyui import comfyui_tensors
from xeonsd.modelfiles.lora_layout import LoraFormatError, read_adapter
from xeonsd.trainer.methods.adapters import PEFT_CONFIG, PEFT_WEIGHTS

PROMPT = "a photo of sks toy"
FLAGS = (
    "--rank=4",
    "--learning_rate=1e-2",
    "--checkpointing_steps=2",
    f"--instance_prompt={PROMPT}",
    "--save_format=comfyui",  # ComfyUI's file beside the result (tests/xeonsd/test_lora_comfyui.py: its layout)
)


@pytest.fixture(scope="module")
def adapter_runs(tiny_model, tiny_flux_model, dataset, tmp_path_factory):
    """``runs(family, adapter, ranks=1, kind="short")``: the output dir of that run (4 steps, 1 rank x batch 2 or
    2 ranks x batch 1; ``resume``: the 2-rank run's checkpoint-2 resumed on 1 rank x batch 2), trained once."""
    root = tmp_path_factory.mktemp("adapter-runs")
    models = {"sd": tiny_model, "flux": tiny_flux_model}
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done: dict[tuple, Path] = {}

    def runs(family: str, adapter: str, ranks: int = 1, kind: str = "short") -> Path:
        key = (family, adapter, ranks, kind)
        if key not in done:
            out = root / "-".join(map(str, key))
            extra = [*FLAGS, f"--adapter={adapter}"]
            if kind == "resume":
                out.mkdir()
                shutil.copytree(runs(family, adapter, 2) / "checkpoint-2", out / "checkpoint-2")
                extra.append("--resume_from_checkpoint=latest")
            args = method_args("lora", models[family], dataset, out, *extra, steps=4, batch=2 if ranks == 1 else 1)
            if family == "flux":  # the model's own resolution
                args = [a for a in args if not a.startswith("--resolution")]
            (root / f"{out.name}.log").write_text(train(args, env, ranks=ranks).stderr)
            done[key] = out
        return done[key]

    runs.root = root  # type: ignore[attr-defined]
    return runs


def stock_pipeline(family: str, model: Path):
    from diffusers import FluxPipeline, StableDiffusionPipeline

    pipe = (FluxPipeline if family == "flux" else StableDiffusionPipeline).from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generated(pipe) -> torch.Tensor:
    """The latents two denoising steps make from a fixed seed."""
    kw = {"max_sequence_length": 32} if "Flux" in type(pipe).__name__ else {}
    out = pipe(PROMPT, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="latent", **kw)
    return out.images


def family_name(family: str) -> str:
    """The denoiser's component name, the prefix ComfyUI's file gives its modules (``unet`` as ``lora_unet_``)."""
    return "transformer" if family == "flux" else "unet"


def denoiser(pipe) -> torch.nn.Module:
    return pipe.transformer if hasattr(pipe, "transformer") else pipe.unet


@pytest.mark.parametrize(
    # each type once (the suite's time): DoRA on a flow transformer, LoKr and LoHa on a UNet; the layers are peft's
    # either way, and the LoKr run is also the 2-rank and resume test's 1-rank run
    ("family", "adapter"),
    [("flux", "dora"), ("sd", "lokr"), ("sd", "loha")],
)
def test_each_adapter_loads_back_with_its_trained_weights_and_changes_the_output(
    family, adapter, adapter_runs, tiny_model, tiny_flux_model
):
    out = adapter_runs(family, adapter)
    summary = json.loads((out / "train_summary.json").read_text())
    pipe = stock_pipeline(family, tiny_flux_model if family == "flux" else tiny_model)
    base = generated(pipe)
    if adapter == "dora":  # diffusers' layout with peft's magnitude vectors: load_lora_weights reads them
        assert summary["result"]["path"] == LORA_FILE and not (out / PEFT_WEIGHTS).exists()
        saved = {k: v for k, v in load_file(str(out / LORA_FILE)).items() if "lora_magnitude_vector" in k}
        pipe.load_lora_weights(out, weight_name=LORA_FILE)
        loaded = {n: p for n, p in denoiser(pipe).named_parameters() if "lora_magnitude_vector" in n}
        assert saved and len(loaded) == len(saved)
        # <denoiser>.<module>.lora_magnitude_vector -> <module>.lora_magnitude_vector.<name>.weight
        for key, value in saved.items():
            module = key.split(".", 1)[1].removesuffix(".lora_magnitude_vector")
            (name,) = [n for n in loaded if n.startswith(f"{module}.lora_magnitude_vector.")]
            assert torch.equal(loaded[name].detach(), value), key
    else:  # peft's layout: PeftModel.from_pretrained puts the adapter onto the denoiser in place
        from peft import PeftModel
        from peft.utils import get_peft_model_state_dict

        assert summary["result"]["path"] == PEFT_WEIGHTS and (out / PEFT_CONFIG).exists()
        assert not (out / LORA_FILE).exists()
        peft_model = PeftModel.from_pretrained(denoiser(pipe), out)
        saved, loaded = load_file(str(out / PEFT_WEIGHTS)), get_peft_model_state_dict(peft_model)
        assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert summary["adapter"] == adapter
    # --save_format comfyui: the same trained adapter in ComfyUI's layout (DoRA's scale from the base weights the
    # run held, in the training dtype)
    loaded_as = "default_0" if adapter == "dora" else "default"  # load_lora_weights' adapter name, peft's
    comfy = load_file(str(out / COMFYUI_FILE))
    again = comfyui_tensors({family_name(family): denoiser(pipe)}, loaded_as)
    assert comfy and comfy.keys() == again.keys()
    for key, value in comfy.items():
        tolerance = {"rtol": 1e-2, "atol": 1e-3} if key.endswith(".dora_scale") else {"rtol": 0, "atol": 0}
        torch.testing.assert_close(value, again[key], **tolerance, msg=key)
    assert (generated(pipe) - base).abs().max() > 1e-4  # the adapter is applied
    # xeonsd's LoRA readers (generate --lora, serve --adapter, export --lora: GenAI applies B A only) name the type
    kind = {"dora": "DoRA", "lokr": "LoKr", "loha": "LoHa"}[adapter]
    with pytest.raises(LoraFormatError, match=f"is a {kind} adapter, not plain LoRA: OpenVINO GenAI"):
        read_adapter(out / summary["result"]["path"])


def test_lokr_two_ranks_and_a_resume_learn_what_one_rank_with_double_batch_learns(adapter_runs):
    one, two = adapter_runs("sd", "lokr"), adapter_runs("sd", "lokr", 2)
    resumed = adapter_runs("sd", "lokr", 1, "resume")
    assert "resumed from" in (adapter_runs.root / f"{resumed.name}.log").read_text()

    def w1(out: Path) -> dict[str, torch.Tensor]:  # LoKr's first factor starts at zero: its value is what was learned
        return {k: v for k, v in load_file(str(out / PEFT_WEIGHTS)).items() if k.endswith("lokr_w1")}

    zero = {k: torch.zeros_like(v) for k, v in w1(one).items()}
    assert zero and w1(one).keys() == w1(two).keys() == w1(resumed).keys()
    assert_same_training(w1(one), w1(two), zero)
    assert_same_training(w1(one), w1(resumed), zero)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--adapter=lokr", "--train_text_encoder"], "--adapter lokr adapts the denoiser only: leave out"),
        (["--adapter=dora", "--save_format=kohya"], "--save_format kohya: the kohya layout holds plain LoRA"),
    ],
)
def test_what_another_adapter_type_cannot_do_is_refused_naming_the_fix(flags, message, tiny_model, dataset, tmp_path):
    from xeonsd.trainer.argv import parse_config
    from xeonsd.trainer.config import ConfigError
    from xeonsd.trainer.methods import method_class

    cfg = parse_config(method_args("lora", tiny_model, dataset, tmp_path, *flags, f"--instance_prompt={PROMPT}"))
    with pytest.raises(ConfigError, match=message):
        method_class("lora").check(cfg, None)


def test_an_adapter_type_with_another_method_is_refused(tiny_model, dataset, tmp_path):
    from xeonsd.trainer.argv import parse_config
    from xeonsd.trainer.config import ConfigError

    for method in ("full", "textual_inversion"):
        with pytest.raises(ConfigError, match=f"--method {method} does not use --adapter \\(a lora flag\\)"):
            parse_config(method_args(method, tiny_model, dataset, tmp_path, "--adapter=lokr"))
