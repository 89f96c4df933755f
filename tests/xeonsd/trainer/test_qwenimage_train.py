"""Qwen-Image training on the tiny pipeline (``make_tiny_model(arch="tiny-qwenimage")``: Qwen2.5-VL text, the
Wan-style 3D VAE, the packed-token MMDiT), its runs under real mpirun shared by the tests (one module-scoped cache):

* what the family feeds the transformer is what diffusers' QwenImagePipeline and train_dreambooth_lora_qwen_image.py
  compute: the prompt embeddings and masks (two prompts of different lengths joined as the script joins instance
  and class prompts), the per-channel normalised single-frame latents, the packed tokens, σ from the scheduler's
  unshifted training grid, the unpacked prediction;
* 2 ranks x batch 1 learn what 1 rank x batch 2 learns: captions of different lengths (a batch of 2 pads the
  shorter and masks it, a batch of 1 has no padding), caption dropout, prior preservation (class images from the
  tiny pipeline), the validation loss at fixed σ and a validation image; a resume of the 2-rank run's step-2
  checkpoint on 1 rank ends where the uninterrupted run ends;
* the LoRA file is diffusers' layout, stock ``QwenImagePipeline.load_lora_weights`` loads it and the image changes;
  a FLUX.1 adapter is refused naming both families;
* the learning proof: trained on the red-square concept, the stock pipeline with the LoRA generates latents closer
  to the concept's than the base model, for the same seeds;
* --method full trains with aspect-ratio buckets and --weighting_scheme, and the saved pipeline loads; textual
  inversion and --train_text_encoder are refused in one line.
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
# captions of different lengths: a batch of two pads one and masks it
CAPTIONS = (
    "a photo of sks toy",
    "a photo of sks toy, a red card with a white square in the middle of it",
    "sks toy",
    "a red sks toy with a white square",
)
COMMON = ("--rank=2", "--lora_alpha=4", "--learning_rate=1e-2", "--checkpointing_steps=2")
SHORT = (
    "--caption_dropout=0.5",
    "--validation_split=0.25",
    "--validation_steps=2",
    "--with_prior_preservation",
    "--class_prompt=a photo of toy",
    "--num_class_images=2",
    f"--validation_prompt={PROMPT}",
    "--num_validation_images=1",
)
# LoRA on the attention (both streams), the MLPs, the modulations and the in/out projections, rank 16: the learning
# proof's adapters (the script's default, the image stream's attention, moves a random tiny transformer too little)
LEARN_LAYERS = (
    "to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out,img_mlp.net.0.proj,img_mlp.net.2,"
    "txt_mlp.net.0.proj,txt_mlp.net.2,img_mod.1,txt_mod.1,img_in,txt_in,proj_out"
)
LEARN = ("--rank=16", f"--lora_layers={LEARN_LAYERS}", "--learning_rate=1e-2", "--checkpointing_steps=0")
# The trained distance to the concept is at most this fraction of the base's. Measured on the tiny pipeline (30
# steps, batch 4): 0.81; the target flipped (x0 - eps) gives 0.99.
MARGIN = 0.90


@pytest.fixture(scope="module")
def tiny_qwenimage_model(tmp_path_factory) -> Path:
    from xeonsd.assets import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("assets") / "tiny-qwenimage", arch="tiny-qwenimage")


@pytest.fixture(scope="module")
def pipe(tiny_qwenimage_model):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_qwenimage_model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def runs(tiny_qwenimage_model, concept, tmp_path_factory):  # noqa: F811 - the imported fixture
    """``runs(ranks, kind)``: the output dir of that run, trained once. ``kind``: ``short`` (4 steps on the
    captioned concept with SHORT's flags; 1 rank x batch 2 or 2 ranks x batch 1), ``resume`` (the 2-rank run's
    checkpoint-2 resumed on 1 rank x batch 2), ``learn`` (30 steps, batch 4, on 1 rank) or ``full`` (--method full,
    3 steps with buckets)."""
    root = tmp_path_factory.mktemp("qwenimage-runs")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    captioned = root / "captioned"
    shutil.copytree(concept, captioned)
    for image, caption in zip(sorted(captioned.glob("*.png")), CAPTIONS, strict=True):
        image.with_suffix(".txt").write_text(caption)
    model = tiny_qwenimage_model
    done: dict[tuple, Path] = {}

    def runs(ranks: int, kind: str = "short") -> Path:
        key = (ranks, kind)
        if key not in done:
            out = root / f"{ranks}-{kind}"
            if kind == "learn":
                cmd = method_args("lora", model, concept, out, *LEARN, f"--instance_prompt={PROMPT}", steps=30, batch=4)
            elif kind == "full":
                data = with_other_sizes(concept, root / "buckets")
                flags = ("--buckets", "--bucket_reso_steps=32", "--weighting_scheme=logit_normal")
                cmd = method_args("full", model, data, out, *flags, f"--instance_prompt={PROMPT}", steps=3)
            else:
                if kind == "resume":
                    out.mkdir()
                    shutil.copytree(runs(2) / "checkpoint-2", out / "checkpoint-2")
                flags = (*COMMON, *SHORT, f"--class_data_dir={root / 'class'}")
                flags += ("--resume_from_checkpoint=latest",) if kind == "resume" else ()
                cmd = method_args("lora", model, captioned, out, *flags, steps=4, batch=2 if ranks == 1 else 1)
            (root / f"{out.name}.log").write_text(train(cmd, env, ranks=ranks).stderr)
            done[key] = out
        return done[key]

    runs.root = root  # type: ignore[attr-defined]
    runs.env = env  # type: ignore[attr-defined]
    return runs


def lora_b(path: Path) -> dict[str, torch.Tensor]:
    """The adapters' B matrices: they start at zero, so their value is what the run learned."""
    return {k: v for k, v in load_file(str(path / LORA_FILE)).items() if "lora_B" in k}


def log_of(runs, out: Path) -> str:
    return (runs.root / f"{out.name}.log").read_text()


def test_the_transformer_gets_what_the_script_and_pipeline_compute(pipe):
    """Two prompts of different lengths through the family's conditioning, joined as prior preservation joins the
    instance and class rows, against the pipeline's encode_prompt and the script's concat/pack/call/unpack."""
    from diffusers import QwenImagePipeline

    from xeonsd.families.qwenimage.training import TRAINING as QWENIMAGE
    from xeonsd.families.qwenimage.training import QwenPromptConditioning
    from xeonsd.trainer.flow import FlowSchedule
    from xeonsd.trainer.prompt_tables import PromptTable

    flow = FlowSchedule.from_config(pipe.scheduler.config, "none", 0.0, 1.0, 1.29)
    models = SimpleNamespace(
        tokenizer=pipe.tokenizer,
        text_encoder=pipe.text_encoder,
        text_pairs=[(pipe.tokenizer, pipe.text_encoder)],
        weight_dtype=torch.float32,
        text_length=512,
        text_pending={},  # every encoder loaded
        unet_dtype=torch.float32,
        unet_autocast=False,
        flow=flow,
    )
    short, long = PROMPT, "a photo of a toy that is red and has a white square on it"
    inputs = [
        QwenPromptConditioning(models, PromptTable((p,), per_image=False, source="x"), False, 0, 1).unet_inputs(
            None, [SimpleNamespace(template=0, index=0, input_id=0)]
        )
        for p in (short, long)
    ]
    hidden = torch.cat([h for h, _ in inputs])
    added = {"mask": torch.cat([a["mask"] for _, a in inputs])}
    g = torch.Generator().manual_seed(0)
    latents, noise = torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 16, 8, 8, generator=g)
    sigmas = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        pred, target = QWENIMAGE.predict(models, pipe.transformer, latents, noise, sigmas, hidden, added)

        (e1, m1), (e2, m2) = pipe.encode_prompt(short), pipe.encode_prompt(long)
        assert m1 is None and m2 is None  # one prompt alone: no padding, no mask
        width = max(e1.shape[1], e2.shape[1])  # the script's concat_prompt_embedding_batches
        embeds = torch.cat([torch.nn.functional.pad(e, (0, 0, 0, width - e.shape[1])) for e in (e1, e2)])
        mask = (torch.arange(width)[None] < torch.tensor([[e1.shape[1]], [e2.shape[1]]])).long()
        s = sigmas.view(2, 1, 1, 1, 1)
        noisy = ((1 - s) * latents[:, :, None] + s * noise[:, :, None]).permute(0, 2, 1, 3, 4)
        packed = QwenImagePipeline._pack_latents(noisy, 2, 16, 8, 8)
        timesteps = sigmas * 1000  # noise_scheduler.timesteps: σ x 1000, given as timesteps / 1000
        out = pipe.transformer(
            hidden_states=packed,
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask,
            timestep=timesteps / 1000,
            img_shapes=[(1, 4, 4)] * 2,
            return_dict=False,
        )[0]
        expected = QwenImagePipeline._unpack_latents(out, 64, 64, 8)[:, :, 0]
    assert torch.allclose(pred, expected, atol=1e-5), (pred - expected).abs().max()
    assert torch.equal(target, noise - latents)

    # the latents: one frame through the VAE, (z - latents_mean) / latents_std per channel
    vae = QWENIMAGE.latent_vae(pipe.vae)
    pixels = torch.rand(1, 3, 64, 64, generator=g) * 2 - 1
    with torch.no_grad():
        dist = vae.encode(pixels).latent_dist
        want = pipe.vae.encode(pixels.unsqueeze(2)).latent_dist.mean[:, :, 0]
    assert dist.mean.shape == (1, *QWENIMAGE.latent_dims(pipe.vae.config, 8, 64, 64)) == (1, 16, 8, 8)
    assert torch.equal(dist.mean, want)
    shift, scaling = QWENIMAGE.latent_affine(pipe.vae)
    c = pipe.vae.config
    assert torch.allclose(
        (want - shift) * scaling,
        (want - torch.tensor(c.latents_mean).view(1, 16, 1, 1)) / torch.tensor(c.latents_std).view(1, 16, 1, 1),
    )

    # σ: the scheduler's training grid as it stands (use_dynamic_shifting: unshifted), at index ⌊u·N⌋
    import dataclasses

    assert not QWENIMAGE.resolution_shift
    grid = dataclasses.replace(flow, dynamic=False)
    for u in (0.0, 0.1234, 0.5, 0.999):
        assert grid.sigma(u, (16, 8, 8)) == pytest.approx(float(pipe.scheduler.sigmas[int(u * 1000)]), abs=1e-7)


def test_two_ranks_and_a_resume_learn_what_one_rank_with_double_batch_learns(runs):
    one, two, resumed = runs(1), runs(2), runs(1, "resume")
    summary = json.loads((two / "train_summary.json").read_text())
    assert summary["family"] == "qwenimage" and summary["resolution"] == 64 and summary["ranks"] == 2
    assert summary["loss"]["weighting_scheme"] == "none" and summary["loss"]["shift"] == 1.0  # the script's grid
    zero = {k: torch.zeros_like(v) for k, v in lora_b(one).items()}
    assert_same_training(lora_b(one), lora_b(two), zero)
    assert "resumed from" in log_of(runs, resumed)
    assert_same_training(lora_b(one), lora_b(resumed), zero)
    text = log_of(runs, one)
    assert (
        "Qwen2_5_VLForConditionalGeneration freed: every prompt is encoded; resident memory" in text
    )  # Qwen2.5-VL, the long encoder
    assert "class images: 0 reused, 2 generated" in text and "class images: 2 reused" in log_of(runs, two)
    assert (one / "validation" / "final" / "00.png").is_file()
    rows = [[json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (one, two)]
    val = [[r["val_loss"] for r in rs if "val_loss" in r] for rs in rows]  # at fixed σ: the same on 1 and 2 ranks
    assert len(val[0]) == 2 and val[0] == pytest.approx(val[1], rel=1e-4)


def test_the_lora_is_diffusers_layout_and_stock_diffusers_loads_it(runs, pipe):
    out = runs(1)
    keys = load_file(str(out / LORA_FILE)).keys()
    assert {k.split(".", 1)[0] for k in keys} == {"transformer"}  # Qwen2.5-VL never gets adapters
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)
    modules = {k.split(".", 3)[3].rsplit(".", 2)[0] for k in keys}  # the script's default targets
    assert modules == {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"}, modules

    kw = {"num_inference_steps": 4, "height": 64, "width": 64, "output_type": "np"}
    before = pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(0), **kw).images
    pipe.load_lora_weights(str(out), weight_name=LORA_FILE, adapter_name="short")
    try:
        assert {c.lora_alpha for c in pipe.transformer.peft_config.values()} == {4}, "alpha not recorded"
        after = pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(0), **kw).images
    finally:
        pipe.delete_adapters("short")
    assert np.abs(after - before).max() > 1e-3, "the LoRA does not change the image"


def test_another_familys_lora_is_refused_naming_both(tmp_path):
    """A FLUX.1 adapter (diffusers layout: its single-stream blocks) given to a Qwen-Image model."""
    from xeonsd.modelfiles.lora_layout import LoraFormatError, check_family, read_adapter

    path = tmp_path / "flux1.safetensors"
    tensors = {}
    for name in ("attn.to_q", "attn.to_k", "proj_mlp"):
        tensors[f"transformer.single_transformer_blocks.0.{name}.lora_A.weight"] = torch.zeros(2, 32)
        tensors[f"transformer.single_transformer_blocks.0.{name}.lora_B.weight"] = torch.zeros(32, 2)
    save_file(tensors, str(path))
    with pytest.raises(LoraFormatError) as err:
        check_family(path, read_adapter(path), by_name("qwenimage"), "the tiny Qwen-Image")
    assert "made for FLUX.1" in str(err.value) and "is Qwen-Image" in str(err.value)


@torch.no_grad()
def generated_latents(pipe) -> torch.Tensor:
    """The latents 4 seeds generate in 10 steps (no true CFG), unpacked: as the transformer sees them."""
    out = []
    for seed in range(4):
        kw = {"num_inference_steps": 10, "height": 64, "width": 64, "output_type": "latent"}
        latents = pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(seed), **kw).images
        out.append(pipe._unpack_latents(latents, 64, 64, pipe.vae_scale_factor)[0, :, 0])
    return torch.stack(out)


@torch.no_grad()
def concept_latent(pipe, data: Path) -> torch.Tensor:
    """The concept images' mean latent, normalised per channel as the training latents are."""
    files = sorted(data.glob("*.png"))
    px = [torch.from_numpy(np.asarray(Image.open(f).convert("RGB"), np.float32) / 127.5 - 1) for f in files]
    mean = pipe.vae.encode(torch.stack(px).permute(0, 3, 1, 2).unsqueeze(2)).latent_dist.mean[:, :, 0]
    c = pipe.vae.config
    return (
        (mean - torch.tensor(c.latents_mean).view(1, -1, 1, 1)) / torch.tensor(c.latents_std).view(1, -1, 1, 1)
    ).mean(0)


def test_the_lora_generates_the_concept_in_stock_diffusers(runs, pipe, concept):  # noqa: F811
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
    print(f"Qwen-Image LoRA: latent RMS distance to the concept {a:.3f} -> {b:.3f} ({b / a:.2f})")
    assert b <= MARGIN * a, (a, b)


def test_full_fine_tuning_with_buckets_saves_a_pipeline_that_loads(runs, pipe):
    from diffusers import QwenImagePipeline

    out = runs(1, "full")
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["family"] == "qwenimage" and summary["loss"]["weighting_scheme"] == "logit_normal"
    assert "aspect-ratio buckets: 3 bucket(s)" in log_of(runs, out)  # 32x96, 64x64, 96x32: 2x6 tokens and 4x4
    tuned = QwenImagePipeline.from_pretrained(out)
    changed = [
        n for n, p in tuned.transformer.named_parameters() if not torch.equal(p, pipe.transformer.get_parameter(n))
    ]
    assert changed, "full fine-tuning changed no weight of the transformer"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--method=textual_inversion", "--placeholder_token=<sks>", "--initializer_token=toy"), "textual_inversion"),
        (("--method=lora", "--train_text_encoder", f"--instance_prompt={PROMPT}"), "--train_text_encoder"),
    ],
)
def test_what_does_not_apply_is_refused_in_one_line(flags, message, runs, tiny_qwenimage_model, concept, tmp_path):  # noqa: F811
    args = [f"--pretrained_model_name_or_path={tiny_qwenimage_model}", f"--train_data_dir={concept}"]
    args += [*flags, f"--output_dir={tmp_path / 'out'}"]
    err = refused(args, runs.env)
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and message in lines[0] and "Qwen-Image" in lines[0], err
