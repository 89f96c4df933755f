"""The proof that every method learns: trained on a concept the base model cannot produce, the result generates
images measurably closer to the training images than the base model does, for the same seeds.

The concept: 4 images of one saturated red with a white square. The tiny models' VAE is random, so pixels come
back from it grey whatever the latents; the comparison is made where the model works, in the VAE's latent space:
the metric is the RMS distance between the generated latents (the pipeline's ``output_type="latent"``, 10 PNDM
steps, no guidance) and the mean of the training images' scaled VAE latent means. The base model's random UNet
lands far from the concept; a wrong target, a wrong noise schedule or a sign error in the loss leaves the trained
one as far or farther. Asserted: trained ≤ MARGIN (0.85) × base, for ε and v prediction, min-SNR on and off, and with
prior preservation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from cli_runs import method_args, train
from PIL import Image

MARGIN = 0.85  # the trained distance is at most this fraction of the base's (measured: full 0.20 and 0.39)
SEEDS = range(4)
PROMPT = "a photo of sks toy"
TI_PROMPT = "a photo of <sks>"
STEPS = {"textual_inversion": 100, "lora": 100, "full": 60}
LR = {"textual_inversion": "5e-2", "lora": "2e-2", "full": "1e-3"}
# (model, method, --snr_gamma): full fine-tuning on ε and v prediction, once with min-SNR and once without.
# Textual inversion and LoRA are not here yet: on these random tiny models their steps and rates are not calibrated
# (LoRA measured once at 0.76, TI not at all), and a margin fixed on one run would be a guess.
CASES = [
    ("tiny", "full", "5"),
    ("tiny-v", "full", None),
]


@pytest.fixture(scope="module")
def concept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("concept")
    for i in range(4):
        a = np.zeros((64, 64, 3), np.uint8)
        a[:] = (230, 30, 30)
        a[16 + 4 * i : 40 + 4 * i, 16:40] = 255  # the square moves a little: 4 distinct images
        Image.fromarray(a).save(out / f"c{i}.png")
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Path]:
    from xeonsd.assets import make_tiny_model

    return {"tiny": tiny_model, "tiny-v": make_tiny_model(tmp_path_factory.mktemp("assets") / "tv", arch="tiny-v")}


def train_concept(model: Path, data: Path, out: Path, method: str, env: dict[str, str], *extra: str) -> Path:
    """Train ``method`` on the concept (the later of two equal flags wins: the learning rate here)."""
    args = method_args(method, model, data, out, f"--learning_rate={LR[method]}", *extra, steps=STEPS[method], batch=4)
    if method == "textual_inversion":
        args = [a.replace("<dicoo>", "<sks>") for a in args]
    else:
        args.append(f"--instance_prompt={PROMPT}")
    train(args, env)
    return out


def pipeline(model: Path, method: str | None = None, result: Path | None = None):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(result if method == "full" else model, safety_checker=None)
    if method == "lora":
        pipe.load_lora_weights(str(result))
    elif method == "textual_inversion":
        pipe.load_textual_inversion(str(result / "learned_embeds.safetensors"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def generated_latents(pipe, prompt: str) -> torch.Tensor:
    out = []
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        kw = {"num_inference_steps": 10, "generator": g, "height": 64, "width": 64, "guidance_scale": 1.0}
        out.append(pipe(prompt, output_type="latent", **kw).images[0])
    return torch.stack(out)


@torch.no_grad()
def concept_latent(pipe, data: Path) -> torch.Tensor:
    files = sorted(data.glob("*.png"))
    px = [torch.from_numpy(np.asarray(Image.open(f).convert("RGB"), np.float32) / 127.5 - 1) for f in files]
    dist = pipe.vae.encode(torch.stack(px).permute(0, 3, 1, 2)).latent_dist
    return (dist.mean * pipe.vae.config.scaling_factor).mean(0)


def distance(latents: torch.Tensor, target: torch.Tensor) -> float:
    return float(((latents - target) ** 2).mean().sqrt())


def closer_than_base(model: Path, data: Path, method: str, result: Path) -> tuple[float, float]:
    """(base model's distance, trained model's distance) to the concept, same seeds."""
    base = pipeline(model)
    target = concept_latent(base, data)
    base_prompt = "a photo of toy" if method == "textual_inversion" else PROMPT  # TI: the initializer word
    before = distance(generated_latents(base, base_prompt), target)
    tuned = pipeline(model, method, result)
    after = distance(generated_latents(tuned, TI_PROMPT if method == "textual_inversion" else PROMPT), target)
    return before, after


@pytest.mark.parametrize(("arch", "method", "snr"), CASES, ids=[f"{a}-{m}-snr{s}" for a, m, s in CASES])
def test_the_trained_model_generates_the_concept(arch, method, snr, models, concept, tmp_path, cli_env):
    extra = [f"--snr_gamma={snr}"] if snr else []
    out = train_concept(models[arch], concept, tmp_path / "out", method, cli_env, *extra)
    before, after = closer_than_base(models[arch], concept, method, out)
    print(f"{arch} {method} snr_gamma={snr}: latent RMS distance to the concept base {before:.3f} -> {after:.3f}")
    assert after <= MARGIN * before, (before, after)


def test_the_concept_is_learned_with_prior_preservation(models, concept, tmp_path, cli_env):
    out = tmp_path / "out"
    flags = ["--with_prior_preservation", "--class_prompt=a photo of toy", f"--class_data_dir={tmp_path / 'class'}"]
    method = "full"
    train_concept(
        models["tiny"], concept, out, method, cli_env, *flags, "--num_class_images=4", "--prior_loss_weight=0.5"
    )
    before, after = closer_than_base(models["tiny"], concept, method, out)
    print(f"tiny {method} prior preservation: latent RMS distance to the concept base {before:.3f} -> {after:.3f}")
    assert after <= MARGIN * before, (before, after)
