"""Z-Image's training side (xeonsd.families.zimage.training) on the tiny Z-Image pipeline, the runs under real mpirun
shared by the tests that read them (one module-scoped cache):

* the text is ZImagePipeline.encode_prompt's (chat template, Qwen3's second-last hidden state, padding removed),
  the latents the VAE's mode, and the loss of a batch is the one train_dreambooth_lora_z_image.py computes (the
  timestep (1000 - t) / 1000, the prediction negated against ε − x₀);
* 2 ranks x batch 1 learn what 1 rank x batch 2 learns, and resuming the 2-rank run's step-2 checkpoint on 1 rank
  ends where the uninterrupted run ends; those runs also use prior preservation (class images from the tiny
  ZImagePipeline), caption dropout and the validation loss at fixed σ (the same figure on 1 and 2 ranks);
* the file is diffusers' layout (``transformer.<layers|noise_refiner|context_refiner>.*.attention.to_*``) and reads
  as a Z-Image adapter; a FLUX.1 adapter is refused naming both families;
* the learning proof of test_learning.py: trained on the red-square concept, stock ``ZImagePipeline`` with the
  LoRA loaded generates latents closer to the concept's than the base model, for the same seeds.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cli_runs import method_args, train
from safetensors.torch import load_file, save_file
from test_learning import concept, concept_latent, distance  # noqa: F401 - concept: the fixture
from test_methods import LORA_FILE, assert_same_training

from xeonsd.families import by_name

PROMPT = "a photo of sks toy"
COMMON = (
    "--rank=2",
    "--lora_alpha=4",
    "--learning_rate=1e-2",
    "--checkpointing_steps=2",
    "--caption_dropout=0.5",
    "--validation_split=0.25",
    "--validation_steps=2",
    "--with_prior_preservation",
    "--class_prompt=a photo of toy",
    "--num_class_images=1",
)
# The learning proof's adapters: attention, feed-forward, the patch embedder, the caption embedder and the final
# layer, rank 16 (on the attention alone the random tiny transformer moves too little to tell a bug from a weak
# adapter).
LEARN_LAYERS = "to_q,to_k,to_v,to_out.0,w1,w2,w3,all_x_embedder.2-1,linear,cap_embedder.1"
# The trained distance to the concept is at most this fraction of the base's. Measured on the tiny pipeline (20
# steps, batch 4, lr 2e-2; 3 seeds of 8 steps): 0.77 (1.159 -> 0.896); the prediction left un-negated gives 1.19.
ZIMAGE_MARGIN = 0.9
LEARN = ("--rank=16", f"--lora_layers={LEARN_LAYERS}", "--learning_rate=2e-2", "--checkpointing_steps=0")


@pytest.fixture(scope="module")
def tiny_zimage_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Z-Image-Turbo pipeline (Qwen3, a single-stream transformer with refiners; 64 px)."""
    from xeonsd.assets import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("assets") / "tiny-zimage", arch="tiny-zimage")


@pytest.fixture(scope="module")
def zimage_runs(tiny_zimage_model, concept, tmp_path_factory):  # noqa: F811 - the imported fixture
    """``runs(ranks, kind)``: the output dir of that run, trained once. ``kind``: ``short`` (4 steps; 1 rank x
    batch 2 or 2 ranks x batch 1), ``resume`` (the 2-rank run's checkpoint-2 resumed on 1 rank x batch 2) or
    ``learn`` (20 steps, batch 4, on 1 rank, with a validation image)."""
    root = tmp_path_factory.mktemp("zimage-runs")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done: dict[tuple, Path] = {}

    def args(out: Path, *extra: str, steps: int, batch: int) -> list[str]:
        return [
            *method_args("lora", tiny_zimage_model, concept, out, *extra, steps=steps, batch=batch),
            f"--instance_prompt={PROMPT}",
        ]

    def runs(ranks: int, kind: str = "short") -> Path:
        key = (ranks, kind)
        if key not in done:
            out = root / f"{ranks}-{kind}"
            if kind == "learn":
                cmd = args(out, *LEARN, f"--validation_prompt={PROMPT}", "--num_validation_images=1", steps=20, batch=4)
            else:
                if kind == "resume":
                    out.mkdir()
                    shutil.copytree(runs(2) / "checkpoint-2", out / "checkpoint-2")
                flags = (*COMMON, f"--class_data_dir={root / 'class'}")
                flags += ("--resume_from_checkpoint=latest",) if kind == "resume" else ()
                cmd = args(out, *flags, steps=4, batch=2 if ranks == 1 else 1)
            (root / f"{out.name}.log").write_text(train(cmd, env, ranks=ranks).stderr)
            done[key] = out
        return done[key]

    runs.root = root  # type: ignore[attr-defined]
    return runs


def lora_b(path: Path) -> dict[str, torch.Tensor]:
    """The adapters' B matrices: they start at zero, so their value is what the run learned."""
    return {k: v for k, v in load_file(str(path / LORA_FILE)).items() if "lora_B" in k}


def log_of(runs, out: Path) -> str:
    return (runs.root / f"{out.name}.log").read_text()


def stock_pipeline(model: Path):
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_text_latents_and_loss_are_the_pipeline_s_and_the_script_s(tiny_zimage_model):
    """The prompt table against ZImagePipeline.encode_prompt, and one batch's prediction, target and loss against
    train_dreambooth_lora_z_image.py's lines (its σ and timesteps from a copy of the scheduler)."""
    from xeonsd.families.zimage.training import TRAINING as ZIMAGE
    from xeonsd.trainer.flow import FlowSchedule
    from xeonsd.trainer.prompt_tables import PromptTable

    assert by_name("zimage").training is ZIMAGE
    pipe = stock_pipeline(tiny_zimage_model)
    texts = (PROMPT, "", "red square on a white background, photo")
    models = SimpleNamespace(
        tokenizer=pipe.tokenizer,
        text_encoder=pipe.text_encoder,
        text_length=512,
        weight_dtype=torch.float32,
        text_pairs=[(pipe.tokenizer, pipe.text_encoder)],
        text_pending={},  # every encoder loaded
    )
    table = PromptTable(texts, per_image=False, source="test")
    text = ZIMAGE.conditioning(models, table, trainable=False, rank=0, world=1)
    ref, _ = pipe.encode_prompt(list(texts), do_classifier_free_guidance=False, max_sequence_length=512)
    hidden, lengths = text.encode([0, 1, 2])
    for h, n, r in zip(hidden, lengths.tolist(), ref, strict=True):
        assert n == r.shape[0] and torch.equal(h[:n], r) and not h[n:].any()
    kwargs = text.pipeline_kwargs(PROMPT)
    assert torch.equal(kwargs["prompt_embeds"][0], ref[0]) and torch.equal(kwargs["negative_prompt_embeds"][0], ref[1])

    pixels = torch.rand(1, 3, 64, 64) * 2 - 1
    dist = ZIMAGE.latent_vae(pipe.vae).encode(pixels).latent_dist  # the script's latent_dist.mode()
    assert torch.equal(dist.mean, pipe.vae.encode(pixels).latent_dist.mode()) and not dist.std.any()

    scheduler = copy.deepcopy(pipe.scheduler)
    flow = FlowSchedule.from_config(scheduler.config, "none", 0.0, 1.0, 1.29)
    g = torch.Generator().manual_seed(0)
    latents, noise = torch.randn(3, 16, 8, 8, generator=g), torch.randn(3, 16, 8, 8, generator=g)
    u = torch.tensor([0.0312, 0.5, 0.9731])
    timesteps = scheduler.timesteps[(u * scheduler.config.num_train_timesteps).long()]
    sigmas = scheduler.sigmas[[(scheduler.timesteps == t).nonzero().item() for t in timesteps]].view(-1, 1, 1, 1)
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    with torch.no_grad():
        out = pipe.transformer(list(noisy.unsqueeze(2).unbind(0)), (1000 - timesteps) / 1000, ref, return_dict=False)
        script_pred = -torch.stack(out[0], dim=0).squeeze(2)
        script_loss = ((script_pred - (noise - latents)) ** 2).reshape(3, -1).mean(1).mean()
        ours = SimpleNamespace(unet_dtype=torch.float32, weight_dtype=torch.float32, unet_autocast=False, flow=flow)
        sigma = torch.tensor([flow.sigma(float(x), latents.shape) for x in u])
        pred, target = ZIMAGE.predict(ours, pipe.transformer, latents, noise, sigma, hidden, {"lengths": lengths})
    torch.testing.assert_close(sigma, sigmas.flatten())
    torch.testing.assert_close(pred, script_pred, atol=1e-4, rtol=1e-4)
    assert torch.equal(target, noise - latents)
    torch.testing.assert_close(ZIMAGE.loss(ours, pred, target, sigma, None), script_loss)


def test_two_ranks_and_a_resume_learn_what_one_rank_with_double_batch_learns(zimage_runs):
    one, two, resumed = zimage_runs(1), zimage_runs(2), zimage_runs(1, "resume")
    summary = json.loads((two / "train_summary.json").read_text())
    assert summary["family"] == "zimage" and summary["resolution"] == 64 and summary["ranks"] == 2
    zero = {k: torch.zeros_like(v) for k, v in lora_b(one).items()}
    assert_same_training(lora_b(one), lora_b(two), zero)
    assert "resumed from" in log_of(zimage_runs, resumed)
    assert_same_training(lora_b(one), lora_b(resumed), zero)
    text = log_of(zimage_runs, one)
    assert "Qwen3Model freed: every prompt is encoded" in text  # Qwen3, once every table is built
    assert "class images: 0 reused, 1 generated" in text and "class images: 1 reused" in log_of(zimage_runs, two)
    rows = [[json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (one, two)]
    val = [[r["val_loss"] for r in rs if "val_loss" in r] for rs in rows]
    assert len(val[0]) == 2 and val[0] == pytest.approx(val[1], rel=1e-4)


def test_the_file_is_diffusers_layout_and_reads_as_z_image(zimage_runs, tmp_path):
    from xeonsd.modelfiles.lora_layout import LoraFormatError, check_family, lora_family, read_adapter

    path = zimage_runs(1) / LORA_FILE
    keys = load_file(str(path)).keys()
    # train_dreambooth_lora_z_image.py's default targets, in every block of the three stacks; no text encoder
    blocks = {".".join(k.split(".")[1:3]) for k in keys}
    assert {b.split(".")[0] for b in blocks} == {"layers", "noise_refiner", "context_refiner"}
    assert {k.split(".attention.")[1].rsplit(".lora_", 1)[0] for k in keys} == {"to_q", "to_k", "to_v", "to_out.0"}
    assert all(k.startswith("transformer.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)
    modules = read_adapter(path)
    assert lora_family(modules)[0] is by_name("zimage")
    check_family(path, modules, by_name("zimage"), "tiny-zimage")
    flux = tmp_path / "flux.safetensors"
    name = "transformer.single_transformer_blocks.0.attn.to_q"
    save_file({f"{name}.lora_A.weight": torch.zeros(2, 32), f"{name}.lora_B.weight": torch.zeros(32, 2)}, str(flux))
    with pytest.raises(LoraFormatError, match=r"made for FLUX\.1 .* and tiny-zimage is Z-Image"):
        check_family(flux, read_adapter(flux), by_name("zimage"), "tiny-zimage")


@torch.no_grad()
def generated_latents(pipe) -> torch.Tensor:
    """The latents 3 seeds generate in 8 steps, without classifier-free guidance."""
    kw = {"num_inference_steps": 8, "height": 64, "width": 64, "output_type": "latent", "guidance_scale": 1.0}
    return torch.stack([pipe(PROMPT, generator=torch.Generator().manual_seed(s), **kw).images[0] for s in range(3)])


def test_the_lora_loads_in_stock_diffusers_and_generates_the_concept(zimage_runs, tiny_zimage_model, concept):  # noqa: F811
    """Z-Image's latents are (z - shift) * scale: the concept's are measured the same way."""
    out = zimage_runs(1, "learn")
    assert (out / "validation" / "final" / "00.png").is_file()  # the sample grid, through ZImagePipeline
    pipe = stock_pipeline(tiny_zimage_model)
    target = concept_latent(pipe, concept) - pipe.vae.config.shift_factor * pipe.vae.config.scaling_factor
    before = generated_latents(pipe)
    pipe.load_lora_weights(str(out), weight_name=LORA_FILE)  # (offline, diffusers wants the file's name)
    assert {c.lora_alpha for c in pipe.transformer.peft_config.values()} == {16}, "alpha not recorded"
    after = generated_latents(pipe)
    assert (after - before).abs().max() > 0.1, "the LoRA did not change the image"
    a, b = distance(before, target), distance(after, target)
    print(f"zimage LoRA: latent RMS distance to the concept {a:.3f} -> {b:.3f} ({b / a:.2f})")
    assert b <= ZIMAGE_MARGIN * a, (a, b)
