"""Aspect-ratio buckets, the arithmetic (hand-computed expectations): the bucket set, each image's bucket, its
resize and crop (and SDXL's time ids from it), the flags' errors, and the plan's batches by bucket."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from xeonsd.cluster.launch import RankInfo
from xeonsd.trainer.argv import parse_config
from xeonsd.trainer.buckets import (
    BucketBatches,
    BucketError,
    Buckets,
    _pass_order,
    assign,
    bucket_bounds,
    bucket_sizes,
    nearest_bucket,
    placement,
)
from xeonsd.trainer.config import ConfigError
from xeonsd.trainer.data import SamplingPlan, load_pixels
from xeonsd.trainer.inputs import check_flags

# 512 px, step 64, 256-1024 (the defaults at 512): for each width the largest height within 512² pixels, e.g.
# 320 -> 262144 // 320 = 819 -> 768; 704 -> 372 -> 320; 832 -> 315 -> 256; and the transposes.
BUCKETS_512 = [
    (256, 1024),
    (256, 960),
    (256, 896),
    (256, 832),
    (320, 768),
    (320, 704),
    (384, 640),
    (448, 576),
    (512, 512),
    (576, 448),
    (640, 384),
    (704, 320),
    (768, 320),
    (832, 256),
    (896, 256),
    (960, 256),
    (1024, 256),
]


def test_the_bucket_set_of_512_px_at_step_64():
    assert bucket_bounds(512, None, None, 64) == (256, 1024)
    assert bucket_sizes(512, 256, 1024, 64) == BUCKETS_512


def test_the_bucket_set_of_64_px_at_step_16():
    assert bucket_sizes(64, 48, 80, 16) == [(48, 80), (64, 64), (80, 48)]  # 48 -> 4096 // 48 = 85 -> 80


@pytest.mark.parametrize(
    ("size", "bucket"),
    [
        ((1024, 768), (576, 448)),  # log 4/3 = 0.288; 576/448: 0.251, 640/384: 0.511
        ((768, 1344), (384, 640)),  # log 4/7 = -0.560; 384/640: -0.511
        ((512, 512), (512, 512)),
        ((2000, 400), (1024, 256)),  # log 5: past the widest bucket
        # log(330/760) = -0.834: 320x768 (-0.875) is nearest, but 768 > 760 would upscale: the next, 320x704 (-0.788)
        ((330, 760), (320, 704)),
    ],
)
def test_each_image_goes_to_the_nearest_aspect_ratio_it_covers(size, bucket):
    assert BUCKETS_512[nearest_bucket(size, BUCKETS_512)] == bucket


def test_an_image_smaller_than_every_bucket_is_named_with_its_size(tmp_path):
    Image.new("RGB", (100, 120)).save(tmp_path / "ok.png")
    Image.new("RGB", (40, 72)).save(tmp_path / "tiny.png")
    assert nearest_bucket((40, 72), bucket_sizes(64, 48, 80, 16)) is None
    with pytest.raises(BucketError, match=r"tiny\.png is 40x72: no bucket fits.*smallest bucket is 48x80"):
        assign([tmp_path / "ok.png", tmp_path / "tiny.png"], 64, 48, 80, 16)


def test_assign_lists_only_the_buckets_used(tmp_path):
    for name, size in (("a", (120, 80)), ("b", (70, 110)), ("c", (99, 99)), ("d", (140, 81))):
        Image.new("RGB", size).save(tmp_path / f"{name}.png")
    b = assign(sorted(tmp_path.glob("*.png")), 64, 48, 80, 16)
    assert b.sizes == ((48, 80), (64, 64), (80, 48)) and b.of_image == (2, 0, 1, 2) and b.counts() == [1, 1, 2]
    assert b.record()["buckets"][2] == {"width": 80, "height": 48, "images": 2}
    assert b.describe() == "3 bucket(s) (step 16, 48-80 px): 48x80: 1, 64x64: 1, 80x48: 2"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((64, None, None, 12), "bucket_reso_steps must be a positive multiple of 8"),
        ((64, 40, 80, 16), "min_bucket_reso must be a positive multiple of --bucket_reso_steps 16, got 40"),
        ((64, 80, 128, 16), "--min_bucket_reso 80 <= --resolution 64 <= --max_bucket_reso 128 does not hold"),
    ],
)
def test_bucket_settings_that_cannot_work(args, message):
    with pytest.raises(BucketError, match=message):
        bucket_bounds(*args)


def test_bucket_flags_without_buckets_are_refused():
    cfg = parse_config(["--pretrained_model_name_or_path=m", "--train_data_dir=d", "--min_bucket_reso=256"])
    with pytest.raises(ConfigError, match="--min_bucket_reso shape the aspect-ratio buckets: add --buckets"):
        check_flags(cfg, RankInfo(0, 1, 0, 1, "single"))


def test_the_resize_covers_the_bucket_and_the_crop_is_centred(tmp_path):
    # 95x71 into 64x64: scale max(64/95, 64/71) = 0.9014 -> 86x64; the crop's left (86 - 64) // 2 = 11.
    p = placement((95, 71), (64, 64), center_crop=True)
    assert (p.resized, p.top, p.left, p.left_mirrored) == ((86, 64), 0, 11, 11)
    # 120x81 into 80x48: scale max(80/120, 48/81) = 2/3 -> 80x54; top (54 - 48) // 2 = 3.
    p = placement((120, 81), (80, 48), center_crop=True)
    assert (p.resized, p.top, p.left) == ((80, 54), 3, 0)
    assert placement((120, 81), (80, 48), center_crop=False).resized == (80, 48)  # resized to the bucket

    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (71, 95, 3), dtype=np.uint8)).save(tmp_path / "w.png")
    image, mirror = load_pixels(tmp_path / "w.png", 64, True, placement((95, 71), (64, 64), True))
    assert image.shape == (3, 64, 64)
    expected = Image.open(tmp_path / "w.png").resize((86, 64), Image.Resampling.BICUBIC).crop((11, 0, 75, 64))
    torch.testing.assert_close(image, torch.from_numpy(np.asarray(expected, np.float32) / 127.5 - 1).permute(2, 0, 1))
    torch.testing.assert_close(mirror, image.flip(-1))


def test_sdxl_time_ids_come_from_the_bucket_resize(tmp_path):
    from xeonsd.families.sdxl.training import time_ids_for

    Image.new("RGB", (95, 71)).save(tmp_path / "w.png")
    p = placement((95, 71), (64, 64), center_crop=True)
    ids = time_ids_for(tmp_path / "w.png", 64, True, p)  # (orig h, w, crop top, left, target h, w)
    assert ids.tolist() == [[71, 95, 0, 11, 64, 64], [71, 95, 0, 11, 64, 64]]
    p = placement((97, 71), (64, 64), center_crop=True)  # 87x64: left 11, the mirror's 87 - 64 - 11 = 12
    assert time_ids_for(tmp_path / "w.png", 64, True, p)[:, 3].tolist() == [11, 12]
    p = placement((99, 80), (80, 48), center_crop=True)  # 80x65: top (65 - 48) // 2 = 8
    assert time_ids_for(tmp_path / "w.png", 64, True, p)[0].tolist() == [80, 99, 8, 0, 48, 80]


def test_a_global_batch_comes_from_one_bucket_whatever_the_ranks():
    buckets = Buckets(((48, 80), (64, 64), (80, 48)), (0, 1, 1, 2, 1, 0, 2), 16, 48, 80)
    batches = BucketBatches.for_run(buckets, _Vae(), global_batch=2)
    # per pass: bucket sizes 2, 3, 2 -> 1 + 2 + 1 global batches of 2
    assert batches.pass_length == 8
    plan = SamplingPlan(
        seed=3, num_images=7, num_templates=2, num_timesteps=1000, latent_shape=(4, 8, 8), buckets=batches
    )
    for k in range(0, 40, 2):
        pair = [plan.example(k), plan.example(k + 1)]
        assert len({buckets.of_image[e.input_id // 2] for e in pair}) == 1, k
        shape = batches.latent_shape(pair[0].input_id // 2)
        assert all(e.noise.shape == e.latent_eps.shape == shape for e in pair)
    seen = {plan.example(k).input_id // 2 for k in range(8)}
    assert seen == set(range(7)), "a pass visits every image"
    assert {buckets.of_image[plan.example(k).input_id // 2] for k in range(40)} == {0, 1, 2}
    for step in range(5):  # 2 ranks x batch 1 draw what 1 rank x batch 2 draws
        one = plan.batch(step, 0, 1, 1, 0, 2)
        two = plan.batch(step, 0, 1, 2, 0, 1) + plan.batch(step, 0, 1, 2, 1, 1)
        assert [(e.index, e.input_id, e.timestep) for e in one] == [(e.index, e.input_id, e.timestep) for e in two]
        assert all(torch.equal(a.noise, b.noise) for a, b in zip(one, two, strict=True))
    before = [(e.input_id, e.timestep) for e in (plan.example(k) for k in range(30, 40))]
    _pass_order.cache_clear()  # a resumed run: a fresh process draws the same examples from the same indices
    assert [(e.input_id, e.timestep) for e in (plan.example(k) for k in range(30, 40))] == before


class _Vae:
    class config:  # noqa: N801 - the diffusers attribute name
        block_out_channels = (32, 32, 32, 32)
        latent_channels = 4


def test_the_latent_cache_key_includes_the_bucket(tmp_path):
    from xeonsd.trainer.latents import image_cache_key

    Image.new("RGB", (99, 99)).save(tmp_path / "a.png")
    keys = {image_cache_key(tmp_path / "a.png", "vae", 64, False, bucket=b) for b in (None, (64, 64), (48, 80))}
    assert len(keys) == 3  # and without buckets the key is the one of before (the existing caches stay valid)
