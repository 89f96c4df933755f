"""The demo's pretrained pipeline (xeonsd/assets/demo_model): the shipped files are the ones its build recorded, it
loads as a diffusers StableDiffusionPipeline, and it draws what a caption says: the object's colour in the centre,
the place's colours around it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xeonsd.assets.demo_model import SHIPPED, SUMS, checksums
from xeonsd.assets.scenes import caption, draw, scene

SEEDS = range(3)


def test_the_shipped_files_match_their_recorded_checksums():
    recorded = dict(reversed(line.split("  ", 1)) for line in (SHIPPED / SUMS).read_text().splitlines())
    assert checksums(SHIPPED) == recorded


def test_the_shipped_model_is_small():
    size = sum(p.stat().st_size for p in SHIPPED.rglob("*") if p.is_file())
    assert size < 15e6, size


def test_a_scene_and_its_caption_are_a_function_of_seed_and_index():
    s = scene(0, 5)
    assert s == scene(0, 5) and s != scene(1, 5)
    assert np.array_equal(np.asarray(draw(s)), np.asarray(draw(scene(0, 5))))
    assert s.kind in caption(s, 0, 5)


@pytest.fixture(scope="module")
def pipe():
    from diffusers import StableDiffusionPipeline

    p = StableDiffusionPipeline.from_pretrained(SHIPPED, safety_checker=None)
    p.set_progress_bar_config(disable=True)
    return p


@torch.no_grad()
def drawn(pipe, prompt: str) -> np.ndarray:
    """The prompt's pictures at SEEDS (N x 64 x 64 x 3 floats in [0, 1])."""
    out = []
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        out.append(pipe(prompt, num_inference_steps=20, guidance_scale=4.0, generator=g, output_type="np").images[0])
    return np.stack(out)


def excess(px: np.ndarray, channel: int) -> float:
    """How much ``channel`` stands out of the other two, on average (red: 0, green: 1, blue: 2)."""
    others = [c for c in range(3) if c != channel]
    return float((px[..., channel] - px[..., others].mean(-1)).mean())


def test_the_model_draws_the_colours_and_places_its_captions_name(pipe):
    red_on_grass = drawn(pipe, "a red ball on grass")
    blue_at_beach = drawn(pipe, "a blue cube at the beach")
    centre = (slice(None), slice(26, 42), slice(24, 40))
    ground = (slice(None), slice(54, 64), slice(None))
    sky = (slice(None), slice(0, 10), slice(None))
    print(
        f"centre red {excess(red_on_grass[centre], 0):.3f} vs {excess(blue_at_beach[centre], 0):.3f}, "
        f"centre blue {excess(red_on_grass[centre], 2):.3f} vs {excess(blue_at_beach[centre], 2):.3f}, "
        f"ground green {excess(red_on_grass[ground], 1):.3f} vs {excess(blue_at_beach[ground], 1):.3f}, "
        f"sky blue {excess(red_on_grass[sky], 2):.3f} vs {excess(blue_at_beach[sky], 2):.3f}"
    )
    assert excess(red_on_grass[centre], 0) > excess(blue_at_beach[centre], 0) + 0.2
    assert excess(blue_at_beach[centre], 2) > excess(red_on_grass[centre], 2) + 0.2
    assert excess(red_on_grass[ground], 1) > excess(blue_at_beach[ground], 1) + 0.1
    assert excess(blue_at_beach[sky], 2) > excess(red_on_grass[sky], 2) + 0.1
