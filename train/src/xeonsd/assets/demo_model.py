"""The demo's pretrained pipeline (``xeonsd make-demo-model OUT``): a small Stable Diffusion 1.x pipeline of our own
(AutoencoderKL, CLIP text encoder and tokenizer, UNet2DConditionModel, PNDM), pretrained here on the captioned
scenes of :mod:`.scenes` at 64 px, so that it draws what a caption says ("a red ball on grass") and a concept trained
on it shows in its pictures.

Two stages, one seed, one thread (the weights are the same bit for bit on the same CPU kind): the VAE (downsampling 8:
8 x 8 x 4 latents) learns to reconstruct the scenes; then the UNet and the text encoder learn together to
denoise the scenes' latents given their captions (a tenth of them empty, for classifier-free guidance). The
repository ships the result (:data:`SHIPPED`); its checksums are in ``SHA256SUMS`` beside it."""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xeonsd.assets.parts import Clip, clip_model, vae_of
from xeonsd.assets.scenes import SCENE_WORDS, SIZE, pictures
from xeonsd.assets.vocab import WORDS, build_clip_vocab, clip_tokenizer
from xeonsd.fsutil import atomic_dir

log = logging.getLogger(__name__)

SHIPPED = Path(__file__).parent / "demo_model"
SUMS = "SHA256SUMS"
TEXT = Clip(hidden=64, layers=2, heads=4, intermediate=128)


@dataclass(frozen=True)
class Budget:
    """How long each stage trains: images in the set, steps and batch of the VAE's and the denoiser's stages."""

    images: int = 2048
    vae_steps: int = 800
    vae_batch: int = 8
    unet_steps: int = 2500
    unet_batch: int = 32


def make_demo_model(out: Path, seed: int = 0, budget: Budget = Budget()) -> Path:
    """Pretrain the demo pipeline from ``seed`` and write it to ``out`` with its ``SHA256SUMS``."""
    import torch
    from diffusers import DDPMScheduler, PNDMScheduler, StableDiffusionPipeline

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        vocab, merges = build_clip_vocab([*WORDS, *SCENE_WORDS])
        tokenizer = clip_tokenizer(vocab, merges)
        text_encoder = clip_model(TEXT, vocab, projection=False)
        vae = vae_of((8, 16, 32, 32), 1, 8, SIZE, 1.0)
        unet = _unet()
        betas = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "steps_offset": 1}
        scheduler = PNDMScheduler(**betas, skip_prk_steps=True)
        px, captions = pictures(seed, budget.images)
        images = torch.from_numpy(px).permute(0, 3, 1, 2).float() / 127.5 - 1
        start = time.perf_counter()
        train_vae(vae, images, budget, seed)
        latents = encode(vae, images)
        vae.register_to_config(scaling_factor=round(1 / float(latents.std()), 5))
        latents = latents * vae.config.scaling_factor
        vae_s = time.perf_counter() - start
        ids = tokenizer(captions, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
        empty = tokenizer([""], padding="max_length", max_length=77, return_tensors="pt").input_ids
        train_denoiser(unet, text_encoder, latents, ids, empty, DDPMScheduler.from_config(scheduler.config), budget)
        log.info("pretrained in %.0f s (VAE %.0f s)", time.perf_counter() - start, vae_s)
    finally:
        torch.set_num_threads(threads)
    pipe = StableDiffusionPipeline(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    with atomic_dir(Path(out)) as tmp:
        pipe.save_pretrained(tmp, safe_serialization=True)
        (tmp / SUMS).write_text("".join(f"{h}  {name}\n" for name, h in checksums(tmp).items()))
    return Path(out)


def _unet() -> Any:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=SIZE // 8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=TEXT.hidden,
        attention_head_dim=4,
        norm_num_groups=8,
    )


def train_vae(vae: Any, images: Any, budget: Budget, seed: int) -> None:
    """Reconstruction (L1 + MSE) with a light KL term, on random batches of the scenes."""
    import torch

    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, budget.vae_steps)
    vae.train()
    for step in range(budget.vae_steps):
        x = images[torch.randint(len(images), (budget.vae_batch,), generator=g)]
        dist = vae.encode(x).latent_dist
        rec = vae.decode(dist.sample(generator=g)).sample
        kl = dist.kl().mean() / x[0].numel()
        loss = (rec - x).abs().mean() + ((rec - x) ** 2).mean() + 1e-4 * kl
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == budget.vae_steps - 1:
            log.info("vae step %d/%d loss %.4f", step, budget.vae_steps, loss.item())
    vae.eval()


def encode(vae: Any, images: Any) -> Any:
    """The scenes' latent means (unscaled)."""
    import torch

    with torch.no_grad():
        return torch.cat([vae.encode(b).latent_dist.mean for b in images.split(64)])


def train_denoiser(
    unet: Any, text_encoder: Any, latents: Any, ids: Any, empty: Any, noise_scheduler: Any, budget: Budget
) -> None:
    """ε-prediction on the scenes' latents, the UNet and the text encoder together; a tenth of the captions empty."""
    import torch

    g = torch.Generator().manual_seed(1)
    params = [*unet.parameters(), *text_encoder.parameters()]
    opt = torch.optim.AdamW(params, lr=1.5e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 1.5e-3, total_steps=budget.unet_steps, pct_start=0.05)
    unet.train()
    text_encoder.train()
    for step in range(budget.unet_steps):
        pick = torch.randint(len(latents), (budget.unet_batch,), generator=g)
        x0, tokens = latents[pick], ids[pick].clone()
        tokens[torch.rand(len(pick), generator=g) < 0.1] = empty[0]
        noise = torch.randn(x0.shape, generator=g)
        t = torch.randint(0, noise_scheduler.config.num_train_timesteps, (len(pick),), generator=g)
        noisy = noise_scheduler.add_noise(x0, noise, t)
        pred = unet(noisy, t, text_encoder(tokens)[0]).sample
        loss = torch.nn.functional.mse_loss(pred, noise)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == budget.unet_steps - 1:
            log.info("denoiser step %d/%d loss %.4f", step, budget.unet_steps, loss.item())
    unet.eval()
    text_encoder.eval()


def checksums(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` but the sums file itself, by its path relative to ``root``."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != SUMS)
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
