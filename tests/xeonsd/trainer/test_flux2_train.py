"""FLUX.2 [klein] training on the tiny pipeline (``make_tiny_model(arch="tiny-flux2")``: Qwen3 text, the 2x2
patchified, batch-normalised latents), its runs under real mpirun shared by the tests (one module-scoped cache):

* what the family feeds the transformer is what diffusers' Flux2KleinPipeline and train_dreambooth_lora_flux2_klein.py
  compute: the prompt embeddings and text ids, the latents, the packed tokens and ids, the unpacked prediction;
* 2 ranks x batch 1 learn what 1 rank x batch 2 learns, with prior preservation (class images from the tiny
  pipeline), caption dropout, the validation loss at fixed σ and a validation image; a resume of the 2-rank run's
  step-2 checkpoint on 1 rank ends where the uninterrupted run ends;
* the LoRA file is diffusers' layout, stock ``Flux2KleinPipeline.load_lora_weights`` loads it and the image changes;
  an adapter of another family (FLUX.1) is refused naming both, and ours is refused by a FLUX.1 model;
* the learning proof: trained on the red-square concept, the stock pipeline with the LoRA generates latents closer
  to the concept's than the base model, for the same seeds;
* --method full trains with aspect-ratio buckets and --weighting_scheme; textual inversion and --train_text_encoder
  are refused in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from cli_runs import method_args, refused, train
from PIL import Image
from safetensors.torch import load_file, save_file
from test_learning import concept, distance, with_other_sizes  # noqa: F401 - concept: the fixture
from test_methods import LORA_FILE, assert_same_training

from xeonsd.families import by_name

PROMPT = "a photo of sks toy"
COMMON = ("--rank=2", "--lora_alpha=4", "--learning_rate=1e-2", "--checkpointing_steps=2")
SHORT = (
    "--with_prior_preservation",
    "--class_prompt=a photo of toy",
    "--num_class_images=2",
    f"--validation_prompt={PROMPT}",
    "--num_validation_images=1",
    "--caption_dropout=0.5",
    "--validation_split=0.25",
    "--validation_steps=2",
)
# LoRA on the attention, feed-forward and projection layers, rank 16: the learning proof's adapters (on the
# script's default layers alone the random tiny transformer moves too little: 0.93 of the base's distance)
LEARN_LAYERS = (
    "to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out,ff.linear_in,ff.linear_out,"
    "ff_context.linear_in,ff_context.linear_out,to_qkv_mlp_proj,single_transformer_blocks.0.attn.to_out,"
    "single_transformer_blocks.1.attn.to_out,proj_out,x_embedder,context_embedder"
)
LEARN = ("--rank=16", f"--lora_layers={LEARN_LAYERS}", "--learning_rate=1e-2", "--checkpointing_steps=0")
# The trained distance to the concept is at most this fraction of the base's. Measured on the tiny pipeline (30
# steps, batch 4): 0.84; the target flipped (x0 - eps) gives 1.04. FLUX.1's and SD3's bound (test_flow_train.py).
FLOW_MARGIN = 0.92


@pytest.fixture(scope="module")
def tiny_flux2_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny FLUX.2 [klein] pipeline (a 28-layer tiny Qwen3, the patchifying VAE; 64 px)."""
    from xeonsd.assets import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("assets") / "tiny-flux2", arch="tiny-flux2")


@pytest.fixture(scope="module")
def pipe(tiny_flux2_model):
    from diffusers import Flux2KleinPipeline

    p = Flux2KleinPipeline.from_pretrained(tiny_flux2_model)
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture(scope="module")
def runs(tiny_flux2_model, concept, tmp_path_factory):  # noqa: F811 - the imported fixture
    """``runs(ranks, kind)``: the output dir of that run, trained once. ``kind``: ``short`` (4 steps, SHORT's
    flags; 1 rank x batch 2 or 2 ranks x batch 1), ``resume`` (the 2-rank run's checkpoint-2 resumed on 1 rank x
    batch 2), ``learn`` (30 steps, batch 4, 1 rank) or ``full`` (--method full, 3 steps with buckets)."""
    root = tmp_path_factory.mktemp("flux2-runs")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done: dict[tuple, Path] = {}

    def args(out: Path, *extra: str, steps: int, batch: int, method: str = "lora", data: Path = concept) -> list:
        a = method_args(method, tiny_flux2_model, data, out, *extra, steps=steps, batch=batch)
        return [x for x in a if not x.startswith("--resolution")] + [f"--instance_prompt={PROMPT}"]

    def run(ranks: int, kind: str = "short") -> Path:
        if (ranks, kind) not in done:
            out = root / f"{ranks}-{kind}"
            if kind == "learn":
                cmd = args(out, *LEARN, steps=30, batch=4)
            elif kind == "full":
                buckets = ("--buckets", "--min_bucket_reso=48", "--max_bucket_reso=96", "--bucket_reso_steps=16")
                flags = (*buckets, "--weighting_scheme=logit_normal", "--learning_rate=1e-3")
                cmd = args(out, *flags, steps=3, batch=1, method="full", data=with_other_sizes(concept, root))
            else:
                if kind == "resume":
                    out.mkdir()
                    shutil.copytree(run(2) / "checkpoint-2", out / "checkpoint-2")
                flags = (*COMMON, *SHORT, f"--class_data_dir={root / 'class'}")
                flags += ("--resume_from_checkpoint=latest",) if kind == "resume" else ()
                cmd = args(out, *flags, steps=4, batch=2 if ranks == 1 else 1)
            (root / f"{out.name}.log").write_text(train(cmd, env, ranks=ranks).stderr)
            done[(ranks, kind)] = out
        return done[(ranks, kind)]

    run.root = root  # type: ignore[attr-defined]
    run.env = env  # type: ignore[attr-defined]
    run.args = args  # type: ignore[attr-defined]
    return run


def log_of(runs, out: Path) -> str:
    return (runs.root / f"{out.name}.log").read_text()


def lora_b(path: Path) -> dict[str, torch.Tensor]:
    """The adapters' B matrices: they start at zero, so their value is what the run learned."""
    return {k: v for k, v in load_file(str(path / LORA_FILE)).items() if "lora_B" in k}


def bn_normalised(pipe, latents: torch.Tensor) -> torch.Tensor:
    """Raw VAE latents [n, 32, h, w] as the transformer sees them: patchified, batch-norm normalised."""
    bn = pipe.vae.bn
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
    return (pipe._patchify_latents(latents) - bn.running_mean.view(1, -1, 1, 1)) / std


@torch.no_grad()
def test_the_family_feeds_the_transformer_what_the_pipeline_and_script_compute(pipe):
    from xeonsd.families import vae_scale
    from xeonsd.families.flux2.training import TRAINING as FLUX2
    from xeonsd.families.flux2.training import Flux2PromptConditioning

    prompts = [PROMPT, ""]
    cond = Flux2PromptConditioning.__new__(Flux2PromptConditioning)  # its encoder hooks, without a prompt table
    cond.models = SimpleNamespace(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, text_length=512)
    hidden = cond._t5(cond._tokenize(prompts)[-1])
    expected, expected_ids = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=512)
    assert torch.equal(hidden, expected)  # layers 9, 18, 27 of the chat-templated prompt, side by side

    pixels = torch.rand(2, 3, 64, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    vae = FLUX2.latent_vae(pipe.vae)
    dist = vae.encode(pixels).latent_dist
    shift, scaling = FLUX2.latent_affine(pipe.vae)
    latents = (dist.mean + dist.std * torch.randn_like(dist.mean) - shift) * scaling
    assert FLUX2.latent_dims(vae.config, vae_scale(vae.config), 64, 48) == tuple(latents.shape[1:]) == (128, 4, 3)
    script = bn_normalised(pipe, pipe.vae.encode(pixels).latent_dist.mode())  # the script's model_input
    assert torch.allclose(latents, script, atol=1e-5)

    sigmas = torch.tensor([0.3, 0.8])
    kw = FLUX2.denoiser_kwargs(pipe.transformer.config, script, sigmas, expected, None, {}, SimpleNamespace())
    image_ids = pipe._prepare_latent_ids(script)
    assert torch.equal(kw["img_ids"], image_ids) and torch.equal(kw["txt_ids"], expected_ids)
    assert torch.equal(kw["hidden_states"], pipe._pack_latents(script)) and kw["guidance"] is None
    assert torch.equal(kw["timestep"], sigmas)  # the script's timesteps / 1000
    out = pipe.transformer(**kw, return_dict=False)[0]
    assert torch.equal(FLUX2.unpack(out, script.shape), pipe._unpack_latents_with_ids(out, image_ids))


def test_sigma_is_the_schedulers_unshifted_training_grid(tiny_flux2_model):
    """klein's scheduler has use_dynamic_shifting: its training sigmas, which the script indexes, are unshifted."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from xeonsd.trainer.argv import parse_config
    from xeonsd.trainer.models import load_models

    cfg = parse_config([f"--pretrained_model_name_or_path={tiny_flux2_model}", "--train_data_dir=."])
    flow = load_models(cfg).flow
    assert flow.scheme == "none" and not flow.dynamic
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_flux2_model, subfolder="scheduler")
    for u in (0.0, 0.25, 0.5, 0.9):
        assert flow.sigma(u, (128, 4, 4)) == pytest.approx(float(scheduler.sigmas[int(u * 1000)]))


def test_two_ranks_and_a_resume_learn_what_one_rank_with_double_batch_learns(runs):
    one, two, resumed = runs(1), runs(2), runs(1, "resume")
    summary = json.loads((two / "train_summary.json").read_text())
    assert summary["family"] == "flux2" and summary["resolution"] == 64 and summary["ranks"] == 2
    zero = {k: torch.zeros_like(v) for k, v in lora_b(one).items()}
    assert_same_training(lora_b(one), lora_b(two), zero)
    assert "resumed from" in log_of(runs, resumed)
    assert_same_training(lora_b(one), lora_b(resumed), zero)
    text = log_of(runs, one)
    assert "Qwen3ForCausalLM freed: every prompt is encoded; resident memory" in text  # Qwen3, the long encoder
    assert "class images: 0 reused, 2 generated" in text and "class images: 2 reused" in log_of(runs, two)
    assert (one / "validation" / "final" / "00.png").is_file()
    rows = [[json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (one, two)]
    val = [[r["val_loss"] for r in rs if "val_loss" in r] for rs in rows]  # at fixed σ: the same on 1 and 2 ranks
    assert len(val[0]) == 2 and val[0] == pytest.approx(val[1], rel=1e-4)


def test_the_lora_is_diffusers_layout_and_stock_diffusers_loads_it(runs, pipe):
    from xeonsd.modelfiles.lora_layout import LoraFormatError, check_family, read_adapter

    out = runs(1)
    keys = load_file(str(out / LORA_FILE)).keys()
    assert {k.split(".", 1)[0] for k in keys} == {"transformer"}  # Qwen3 never gets adapters
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)
    assert any(".attn.to_qkv_mlp_proj." in k for k in keys) and any(
        "single_transformer_blocks.1.attn.to_out." in k for k in keys
    )
    modules = read_adapter(out / LORA_FILE)
    check_family(out / LORA_FILE, modules, by_name("flux2"), "the tiny klein")  # its own family: accepted
    with pytest.raises(LoraFormatError, match=r"FLUX\.2 \[klein\].*FLUX\.1"):
        check_family(out / LORA_FILE, modules, by_name("flux"), "a FLUX.1 model")

    kw = {"num_inference_steps": 4, "height": 64, "width": 64, "output_type": "np"}
    before = pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(0), **kw).images
    pipe.load_lora_weights(str(out), weight_name=LORA_FILE, adapter_name="short")
    try:
        after = pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(0), **kw).images
    finally:
        pipe.delete_adapters("short")
    assert np.abs(after - before).max() > 1e-3, "the LoRA does not change the image"


def test_another_familys_lora_is_refused_naming_both(tmp_path):
    """A FLUX.1 adapter (diffusers layout: its single-stream blocks' separate q/k/v) given to a FLUX.2 model."""
    from xeonsd.modelfiles.lora_layout import LoraFormatError, check_family, read_adapter

    path = tmp_path / "flux1.safetensors"
    tensors = {}
    for name in ("attn.to_q", "attn.to_k", "proj_mlp"):
        tensors[f"transformer.single_transformer_blocks.0.{name}.lora_A.weight"] = torch.zeros(2, 32)
        tensors[f"transformer.single_transformer_blocks.0.{name}.lora_B.weight"] = torch.zeros(32, 2)
    save_file(tensors, str(path))
    with pytest.raises(LoraFormatError) as err:
        check_family(path, read_adapter(path), by_name("flux2"), "the tiny klein")
    assert "made for FLUX.1" in str(err.value) and "is FLUX.2 [klein]" in str(err.value)


@torch.no_grad()
def generated_latents(pipe) -> torch.Tensor:
    """The latents 4 seeds generate in 10 steps, as the transformer sees them."""
    out = []
    for seed in range(4):
        kw = {"num_inference_steps": 10, "height": 64, "width": 64, "output_type": "latent", "guidance_scale": 1.0}
        out.append(pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(seed), **kw).images[0])
    return bn_normalised(pipe, torch.stack(out))


@torch.no_grad()
def concept_latent(pipe, data: Path) -> torch.Tensor:
    files = sorted(data.glob("*.png"))
    px = [torch.from_numpy(np.asarray(Image.open(f).convert("RGB"), np.float32) / 127.5 - 1) for f in files]
    mode = pipe.vae.encode(torch.stack(px).permute(0, 3, 1, 2)).latent_dist.mode()
    return bn_normalised(pipe, mode).mean(0)


def test_the_lora_generates_the_concept(runs, pipe, concept):  # noqa: F811
    out = runs(1, "learn")
    target = concept_latent(pipe, concept)
    before = generated_latents(pipe)
    pipe.load_lora_weights(str(out), weight_name=LORA_FILE, adapter_name="learn")
    try:
        assert {c.lora_alpha for c in pipe.transformer.peft_config.values()} == {16}, "alpha not recorded"
        after = generated_latents(pipe)
    finally:
        pipe.delete_adapters("learn")
    a, b = distance(before, target), distance(after, target)
    print(f"flux2 LoRA: latent RMS distance to the concept {a:.3f} -> {b:.3f} ({b / a:.2f})")
    assert b <= FLOW_MARGIN * a, (a, b)


def test_full_fine_tuning_with_buckets_saves_a_stock_pipeline(runs, tiny_flux2_model):
    from diffusers import Flux2Transformer2DModel

    out = runs(1, "full")
    text = log_of(runs, out)
    assert "aspect-ratio buckets: 3 bucket(s) (step 16, 48-96 px): 48x80: 1, 64x64: 4, 80x48: 1" in text
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["loss"]["weighting_scheme"] == "logit_normal" and summary["loss"]["shift"] == 1.0
    trained = Flux2Transformer2DModel.from_pretrained(out, subfolder="transformer").state_dict()
    base = Flux2Transformer2DModel.from_pretrained(tiny_flux2_model, subfolder="transformer").state_dict()
    assert max(float((trained[k] - base[k]).abs().max()) for k in base) > 0, "the transformer did not train"
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "Flux2KleinPipeline"


def test_textual_inversion_and_text_encoder_training_are_refused(runs, tiny_flux2_model, concept):  # noqa: F811
    ti = method_args("textual_inversion", tiny_flux2_model, concept, runs.root / "ti")
    assert "not supported on FLUX.2 [klein]" in refused(ti, runs.env).strip()
    te = runs.args(runs.root / "te", "--train_text_encoder", steps=1, batch=1)
    message = refused(te, runs.env).strip()
    assert "--train_text_encoder: FLUX.2 [klein]'s text encoder" in message and "\n" not in message
