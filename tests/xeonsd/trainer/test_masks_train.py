"""``--masks`` in training: what lies outside the mask is not learned (the trainer's own step on the tiny UNet);
runs with masks on the tiny models (every method, buckets, the latent cache, 2 ranks, FLUX.2 [klein]'s patchified
latents) and the masks it refuses."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from cli_runs import method_args, refused, train
from PIL import Image
from safetensors.torch import load_file
from test_flux2_train import tiny_flux2_model  # noqa: F401 - the fixture
from test_methods import LORA_FILE, assert_same_training

PROMPT = "--instance_prompt=a photo of toy"


def write_masks(data: Path, out: Path, white: str = "left") -> Path:
    """A mask per image of ``data`` in ``out``: its left half white (``white="left"``) or all of it ("all")."""
    out.mkdir(parents=True, exist_ok=True)
    for image in sorted(data.glob("*.png")):
        with Image.open(image) as im:
            w, h = im.size
        grey = np.zeros((h, w), dtype=np.uint8)
        grey[:, : w // 2 if white == "left" else w] = 255
        Image.fromarray(grey).save(out / f"{image.stem}.png")
    return out


def lora(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / LORA_FILE))


def test_an_all_white_mask_trains_what_no_mask_trains_and_half_a_mask_does_not(tiny_model, dataset, tmp_path, cli_env):
    """fp32 LoRA runs: all-white masks give the unmasked run's adapters bit for bit; left halves, others."""
    runs = {}
    for name, masks in (("none", ()), ("white", ("all",)), ("left", ("left",))):
        extra = [f"--masks={write_masks(dataset, tmp_path / f'masks-{name}', masks[0])}"] if masks else []
        args = method_args("lora", tiny_model, dataset, tmp_path / name, PROMPT, "--mixed_precision=no", *extra)
        proc = train(args, cli_env)
        runs[name] = lora(tmp_path / name)
        if masks:
            assert "masked loss: 5 mask(s) from" in proc.stderr
    assert all(torch.equal(runs["none"][k], runs["white"][k]) for k in runs["none"])
    assert any(not torch.equal(runs["none"][k], runs["left"][k]) for k in runs["none"])


def test_what_lies_outside_the_mask_is_not_learned(tiny_model):
    """The trainer's step (step_loss, the SD family's objective) on the tiny UNet, trained 3 steps twice: once on
    latents and noise whose right half differs from the other's. The UNet sees the same noisy input both times
    (x0 and ε changed together outside the mask), so only the target differs, and only outside the mask: with the
    left half as mask the two trainings end at the same weights (up to the input's float rounding), without it
    they do not."""
    from diffusers import DDPMScheduler, UNet2DConditionModel

    from xeonsd.families.sd.training import TRAINING
    from xeonsd.trainer.data import Example
    from xeonsd.trainer.latents import LatentTable
    from xeonsd.trainer.step import LossInputs, step_loss

    scheduler = DDPMScheduler.from_pretrained(tiny_model, subfolder="scheduler")
    c, h, w = 4, 8, 8
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(2, c, h, w, generator=g), torch.randn(2, c, h, w, generator=g)
    t = torch.tensor([300, 700])
    hidden = torch.randn(2, 77, 32, generator=g)
    # outside the mask (the right half): x0 + d and ε - d·√ᾱ/√(1-ᾱ) noise to the same input, with another target ε
    a = scheduler.alphas_cumprod[t].view(-1, 1, 1, 1)
    d = torch.zeros_like(x0)
    d[..., w // 2 :] = 3 * torch.randn(2, c, h, w // 2, generator=g)
    other_x0, other_eps = x0 + d, eps - d * (a.sqrt() / (1 - a).sqrt())
    left = torch.zeros(2, 1, h, w)
    left[..., : w // 2] = 1.0
    text = SimpleNamespace(unet_inputs=lambda latents, examples: (hidden[[e.index for e in examples]], None))

    def trained(latents: torch.Tensor, noise: torch.Tensor, mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        unet = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet")
        models = SimpleNamespace(
            training=TRAINING,
            noise_scheduler=scheduler,
            unet_dtype=torch.float32,
            weight_dtype=torch.float32,
            unet_autocast=False,
        )
        table = LatentTable((c, h, w), 2, 1.0, mean=latents, std=torch.zeros_like(latents), mask=mask)
        inputs = LossInputs(models=models, unet=unet, text=text, latents=table)
        examples = [Example(i, i, 0, int(t[i]), noise[i], torch.zeros(c, h, w)) for i in range(2)]
        optimizer = torch.optim.SGD(unet.parameters(), lr=0.5)
        for _ in range(3):
            step_loss(inputs, examples).backward()
            optimizer.step()
            optimizer.zero_grad()
        return {k: v.detach().clone() for k, v in unet.state_dict().items()}

    base = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet").state_dict()

    def moved(a: dict, b: dict) -> float:
        return max(float((a[k] - b[k]).abs().max()) for k in a)

    masked, masked_other = trained(x0, eps, left), trained(other_x0, other_eps, left)
    plain, plain_other = trained(x0, eps, None), trained(other_x0, other_eps, None)
    update = moved(masked, base)
    assert update > 1e-3, "nothing learned"
    assert moved(masked, masked_other) < 1e-4 * update  # float rounding of the noisy input, nothing else
    assert moved(plain, plain_other) > 0.1 * moved(plain, base)  # unmasked, the right half is learned


def test_masks_two_ranks_learn_what_one_rank_with_double_batch_learns_from_the_latent_cache(
    tiny_model, dataset, tmp_path, cli_env
):
    """Each example's mask follows it to its rank; the disk cache holds latents only and serves a run with masks."""
    masks, cache = write_masks(dataset, tmp_path / "masks"), tmp_path / "cache"
    extra = (PROMPT, f"--masks={masks}", f"--latent_cache_dir={cache}")
    one, two = tmp_path / "one", tmp_path / "two"
    proc = train(method_args("lora", tiny_model, dataset, one, *extra, batch=2), cli_env)
    assert "0 of 5 image(s) reused, 5 encoded" in proc.stderr
    assert all(set(load_file(str(f))) == {"mean", "std"} for f in cache.glob("*.safetensors"))
    proc = train(method_args("lora", tiny_model, dataset, two, *extra), cli_env, ranks=2)
    assert "5 of 5 image(s) reused, 0 encoded" in proc.stderr
    a, b = lora(one), lora(two)
    ups = [k for k in a if "up" in k]
    assert_same_training({k: a[k] for k in ups}, {k: b[k] for k in ups}, {k: torch.zeros_like(a[k]) for k in ups})


@pytest.mark.parametrize("method", ["textual_inversion", "full"])
def test_every_method_trains_with_masks_in_buckets(method, tiny_model, tmp_path, cli_env):
    """Mixed aspect ratios in buckets, centre-cropped: each mask at its bucket's latent size."""
    from xeonsd.assets import make_dataset

    data = tmp_path / "data"
    make_dataset(data, count=4, size=64, sizes="mixed")
    masks = write_masks(data, tmp_path / "masks")
    flags = ("--buckets", "--bucket_reso_steps=16", "--center_crop", f"--masks={masks}")
    flags += (PROMPT,) if method == "full" else ()
    proc = train(method_args(method, tiny_model, data, tmp_path / "out", *flags, steps=2), cli_env)
    assert "masked loss: 4 mask(s)" in proc.stderr and "aspect-ratio buckets" in proc.stderr


def test_prior_preservation_and_the_validation_loss_run_unmasked_beside_masks(tiny_model, dataset, tmp_path, cli_env):
    """The class images' and the held-out images' tables have no masks: their losses are unmasked (a held-out
    image needs no mask), while the instance examples train masked."""
    import hashlib

    masks = write_masks(dataset, tmp_path / "masks")
    # --validation_split 0.2 holds out 1 of the 5: the first by the hash of its name (validation.hold_out)
    held = min(dataset.glob("*.png"), key=lambda p: hashlib.sha256(p.name.encode()).hexdigest())
    (masks / f"{held.stem}.png").unlink()  # a held-out image needs no mask
    flags = (PROMPT, f"--masks={masks}", "--with_prior_preservation", "--class_prompt=a photo of a toy")
    flags += (f"--class_data_dir={tmp_path / 'class'}", "--num_class_images=2")
    flags += ("--validation_split=0.2", "--validation_steps=2")
    out = tmp_path / "out"
    proc = train(method_args("lora", tiny_model, dataset, out, *flags, steps=2), cli_env)
    assert "masked loss: 4 mask(s)" in proc.stderr and "validation loss at step 2" in proc.stderr


def test_flux2_klein_trains_with_masks_at_its_patchified_latent_size(tiny_flux2_model, dataset, tmp_path, cli_env):  # noqa: F811
    """FLUX.2 [klein]'s latents are 2x2-patchified (latent_dims: 4 x 4 at 64 px): the flow objective with masks;
    all-white masks train what no masks train, bit for bit."""
    white = write_masks(dataset, tmp_path / "white", "all")
    runs = {}
    for name, extra in (("none", ()), ("white", (f"--masks={white}",))):
        args = method_args("lora", tiny_flux2_model, dataset, tmp_path / name, PROMPT, "--mixed_precision=no", *extra)
        train(args, cli_env)
        runs[name] = lora(tmp_path / name)
    assert all(torch.equal(runs["none"][k], runs["white"][k]) for k in runs["none"])


def test_a_missing_or_misfit_mask_is_refused_in_one_line_naming_the_file(tiny_model, dataset, tmp_path, cli_env):
    """Before any model loads (exit 2; the unreadable and all-black masks: test_masks.py)."""
    masks = write_masks(dataset, tmp_path / "masks")
    (masks / "dicoo_03.png").unlink()
    args = method_args("lora", tiny_model, dataset, tmp_path / "out", PROMPT, f"--masks={masks}")
    image, mask = dataset / "dicoo_03.png", masks / "dicoo_03.png"
    assert refused(args, cli_env).strip().splitlines() == [
        f"xeonsd train: error: --masks: no mask for training image {image}: expected {mask}"
    ]
    Image.new("L", (32, 32), 255).save(mask)
    assert refused(args, cli_env).strip().splitlines() == [
        f"xeonsd train: error: --masks: mask {mask} is 32x32, its image {image} 64x64; a mask has its image's size"
    ]
