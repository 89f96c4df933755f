"""The masked loss (``--masks``): the masks at latent resolution through their images' crop, bucket and mirror, the
loss they weigh, and (test_masks_train.py) what a run with them learns."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from xeonsd.trainer.buckets import placement
from xeonsd.trainer.data import DataError
from xeonsd.trainer.flow import flow_loss
from xeonsd.trainer.loss import denoising_loss
from xeonsd.trainer.masks import find_masks, latent_mask, mask_rows


def _mask(path: Path, size: tuple[int, int], white_left_of: int) -> Path:
    """A mask of ``size`` (width, height), white in the columns left of ``white_left_of``, black elsewhere."""
    grey = np.zeros((size[1], size[0]), dtype=np.uint8)
    grey[:, :white_left_of] = 255
    Image.fromarray(grey).save(path)
    return path


def test_a_mask_goes_through_its_image_s_bucket_crop_and_mirror_to_latent_pixels(tmp_path):
    # 100x60, white left of x = 45; bucket 64x48 with --center_crop: resized to 80x48 (white left of 36), the bucket
    # cut at left 8 (white left of 28); each latent pixel (8x8) the mean of its pixels: column 3 covers 24..31, half
    mask = _mask(tmp_path / "p0.png", (100, 60), 45)
    place = placement((100, 60), (64, 48), center_crop=True)
    assert (place.resized, place.left) == ((80, 48), 8)
    image, mirrored = latent_mask(mask, 64, True, place, (6, 8))
    row = torch.tensor([1.0, 1.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(image, row.expand(1, 6, 8), atol=1e-6, rtol=0)
    torch.testing.assert_close(mirrored, row.flip(0).expand(1, 6, 8), atol=1e-6, rtol=0)


def test_a_mask_follows_the_centre_crop_and_each_family_s_latent_size(tmp_path):
    """Without buckets: the centre square (left 20 of 100) resized to 48 px, white left of 20. SD's latents (VAE
    scale 8) are 6 wide; FLUX.2 [klein]'s 2x2-patchified ones (its latent_dims) 3, each pixel the mean of 16."""
    from xeonsd.families.flux2.training import TRAINING as FLUX2

    mask = _mask(tmp_path / "p0.png", (100, 60), 45)
    sd = mask_rows([mask], 48, True, None, [(4, 6, 6)] * 2)
    torch.testing.assert_close(sd[0, 0], torch.tensor([1.0, 1.0, 0.5, 0.0, 0.0, 0.0]).expand(6, 6), atol=1e-6, rtol=0)
    torch.testing.assert_close(sd[1], sd[0].flip(-1))
    dims = FLUX2.latent_dims(SimpleNamespace(latent_channels=32), 8, 48, 48)
    assert dims == (128, 3, 3)
    klein = mask_rows([mask], 48, True, None, [dims] * 2)
    assert klein.shape == (2, 1, 3, 3)
    torch.testing.assert_close(klein[0, 0], torch.tensor([1.0, 0.25, 0.0]).expand(3, 3), atol=1e-6, rtol=0)


def test_missing_unreadable_misfit_and_black_masks_are_named(tmp_path):
    images = tmp_path / "data"
    masks = tmp_path / "masks"
    images.mkdir(), masks.mkdir()
    image = images / "p0.jpg"
    Image.new("RGB", (64, 48), "yellow").save(image)
    with pytest.raises(DataError, match=r"no mask for training image .*p0.jpg: expected .*masks/p0.png"):
        find_masks(masks, [image], 48, False)
    (masks / "p0.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match=r"cannot read mask .*masks/p0.png"):
        find_masks(masks, [image], 48, False)
    _mask(masks / "p0.png", (64, 64), 32)
    with pytest.raises(DataError, match=r"mask .*p0.png is 64x64, its image .*p0.jpg 64x48"):
        find_masks(masks, [image], 48, False)
    _mask(masks / "p0.png", (64, 48), 8)  # white only in what the centre crop cuts away
    with pytest.raises(DataError, match=r"mask .*p0.png is black where its image is trained"):
        find_masks(masks, [image], 48, True)
    assert find_masks(masks, [image], 48, False) == {image: masks / "p0.png"}
    _mask(masks / "p0.webp", (64, 48), 8)
    with pytest.raises(DataError, match=r"several masks for training image"):
        find_masks(masks, [image], 48, False)
    with pytest.raises(DataError, match=r"--masks .*nowhere is not a directory"):
        find_masks(tmp_path / "nowhere", [image], 48, False)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pred, target = torch.randn(3, 4, 6, 8, generator=g), torch.randn(3, 4, 6, 8, generator=g)
    return pred, target, torch.tensor([10, 500, 990])


ALPHAS = torch.linspace(0.9999, 0.01, 1000)


@pytest.mark.parametrize("objective", ["epsilon", "epsilon_snr", "v_snr", "flow"])
def test_an_all_white_mask_is_the_unmasked_loss_exactly(objective):
    pred, target, t = _batch()
    ones = torch.ones(3, 1, 6, 8)

    def loss(mask):
        if objective == "flow":
            return flow_loss(pred, target, torch.tensor([1.0, 0.5, 2.0]), mask)
        if objective == "epsilon":
            return denoising_loss(pred, target, t, mask=mask)
        kind = "epsilon" if objective == "epsilon_snr" else "v_prediction"
        return denoising_loss(pred, target, t, snr_gamma=5.0, alphas_cumprod=ALPHAS, prediction_type=kind, mask=mask)

    assert torch.equal(loss(ones), loss(None))


def test_the_unmasked_flow_loss_is_the_one_before_masks():
    pred, target, _ = _batch()
    weights = torch.tensor([1.0, 0.5, 2.0])
    before = ((pred - target) ** 2).reshape(3, -1).mean(dim=1)
    assert torch.equal(flow_loss(pred, target, weights), (before * weights).mean())


@pytest.mark.parametrize("objective", ["epsilon", "epsilon_snr", "flow"])
def test_the_loss_is_blind_where_the_mask_is_black(objective):
    pred, target, t = _batch()
    mask = torch.ones(3, 1, 6, 8)
    mask[:, :, :, 4:] = 0.0  # the right half does not count
    mask[1, :, :3, :4] = 0.5  # grey weighs between

    def loss(p):
        if objective == "flow":
            return flow_loss(p, target, torch.tensor([1.0, 0.5, 2.0]), mask)
        gamma = 5.0 if objective == "epsilon_snr" else None
        return denoising_loss(p, target, t, snr_gamma=gamma, alphas_cumprod=ALPHAS, mask=mask)

    elsewhere = pred.clone()
    elsewhere[..., 4:] += 100 * torch.randn(3, 4, 6, 4)
    assert torch.equal(loss(elsewhere), loss(pred))
    inside = pred.clone()
    inside[..., :4] += 1.0
    assert loss(inside) != loss(pred)
    p = pred.clone().requires_grad_()
    loss(p).backward()
    assert not p.grad[..., 4:].any() and p.grad[..., :4].abs().min() > 0


def test_a_small_subject_does_not_get_a_small_loss():
    """Each example normalised by its mask's sum: an error of 1 everywhere costs 1 under a mask of 1/8 of the
    image as under the whole image (weighed by area, it would cost 1/8)."""
    pred, target = torch.ones(2, 4, 8, 8), torch.zeros(2, 4, 8, 8)
    mask = torch.zeros(2, 1, 8, 8)
    mask[0] = 1.0
    mask[1, :, :2, :4] = 1.0
    assert float(denoising_loss(pred, target, torch.tensor([1, 1]), mask=mask)) == pytest.approx(1.0, abs=1e-6)
    assert float(flow_loss(pred, target, torch.ones(2), mask[1:].expand(2, 1, 8, 8))) == pytest.approx(1.0)
