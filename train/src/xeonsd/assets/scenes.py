"""The captioned pictures the demo model is pretrained on: an object of one kind and colour on one background ("a
red ball on grass", "a photo of a blue cube at the beach"), drawn with flat colours at 64 px. Every picture and
caption is a function of (seed, index), so a rebuild draws the same set."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from xeonsd.templates import OBJECT_TEMPLATES

SIZE = 64
COLOURS = {"red": (220, 40, 40), "blue": (40, 70, 220), "yellow": (240, 205, 40), "purple": (150, 60, 190)}
KINDS = ("ball", "cube", "cone", "toy")  # "toy" (the recipe's initializer word) is a plus-shaped block
PLACES = {"on grass": ((70, 150, 60), None), "at the beach": ((225, 205, 150), (130, 195, 235))}
PLACES["on snow"] = ((235, 235, 240), (120, 130, 150))
# Words the demo model's tokenizer knows as single tokens, besides the tiny vocabulary's.
SCENE_WORDS = [*COLOURS, *KINDS, "grass", "snow", "beach", "dirty", "my", "one"]


@dataclass(frozen=True)
class Scene:
    """One picture's content: its object's kind and colour, where it is, its centre and radius in pixels."""

    kind: str
    colour: str
    place: str
    cx: float
    cy: float
    r: float


def scene(seed: int, index: int) -> Scene:
    """The ``index``-th scene of the set ``seed``: every combination equally likely, the object near the centre."""
    rng = np.random.default_rng([seed, index])
    kind = KINDS[int(rng.integers(len(KINDS)))]
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    place = list(PLACES)[int(rng.integers(len(PLACES)))]
    cx, cy = (SIZE / 2 + rng.uniform(-6, 6, size=2)).tolist()
    return Scene(kind, colour, place, cx, cy + 4, float(rng.uniform(11, 15)))


def draw(s: Scene) -> Image.Image:
    """The scene as a 64 x 64 RGB picture: the ground (the lower two thirds where there is a sky), the object."""
    ground, sky = PLACES[s.place]
    img = Image.new("RGB", (SIZE, SIZE), ground)
    d = ImageDraw.Draw(img)
    if sky is not None:
        d.rectangle([0, 0, SIZE, SIZE // 3], fill=sky)
    fill, (cx, cy, r) = COLOURS[s.colour], (s.cx, s.cy, s.r)
    if s.kind == "ball":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif s.kind == "cube":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
        top = tuple(min(255, v + 50) for v in fill)
        d.polygon([(cx - r, cy - r), (cx - r / 2, cy - 1.4 * r), (cx + 1.4 * r, cy - 1.4 * r), (cx + r, cy - r)], top)
    elif s.kind == "cone":
        d.polygon([(cx, cy - 13 / 10 * r), (cx + r, cy + r), (cx - r, cy + r)], fill=fill)
    else:
        w = r / 2.5
        d.rectangle([cx - r, cy - w, cx + r, cy + w], fill=fill)
        d.rectangle([cx - w, cy - r, cx + w, cy + r], fill=fill)
    return img


def caption(s: Scene, seed: int, index: int) -> str:
    """The scene's caption: "a red ball on grass", sometimes without the colour or the place, sometimes in one of
    the textual-inversion templates ("a photo of a red ball on grass"), so those words mean something too."""
    rng = np.random.default_rng([seed, index, 1])
    words = f"{s.colour} {s.kind}" if rng.random() > 0.15 else s.kind
    if rng.random() > 0.15:
        words += f" {s.place}"
    if rng.random() < 0.5:
        return OBJECT_TEMPLATES[int(rng.integers(len(OBJECT_TEMPLATES)))].format(words)
    return f"a {words}"


def pictures(seed: int, count: int) -> tuple[np.ndarray, list[str]]:
    """``count`` pictures (uint8, N x 64 x 64 x 3) and their captions."""
    scenes = [scene(seed, i) for i in range(count)]
    px = np.stack([np.asarray(draw(s)) for s in scenes])
    return px, [caption(s, seed, i) for i, s in enumerate(scenes)]
