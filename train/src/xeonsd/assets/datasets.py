"""The offline image sets: synthetic pictures of one small object, with captions in each layout the trainer reads."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from xeonsd.fsutil import atomic_dir

log = logging.getLogger("xeonsd.assets")

CAPTION_LAYOUTS = ("metadata", "sidecar", "txt")
_COLOURS = ("red", "green", "blue")
SIZES = ("square", "mixed")
MIXED_ASPECTS = (1.0, 4 / 3, 3 / 4, 3 / 2, 2 / 3, 16 / 9, 9 / 16)  # width / height


def image_sizes(count: int, size: int, sizes: str, seed: int) -> list[tuple[int, int]]:
    """Each image's (width, height): ``square``, ``size`` x ``size``; ``mixed``, one of the aspect ratios of
    ``MIXED_ASPECTS`` with 1.25-1.75 x ``size`` as the side of its square of equal area (so that every image
    covers its aspect-ratio bucket at ``--resolution size`` and is never upscaled). Deterministic in ``seed``."""
    if sizes not in SIZES:
        raise ValueError(f"unknown --sizes {sizes!r}; choose one of {', '.join(SIZES)}")
    if sizes == "square":
        return [(size, size)] * count
    rng = np.random.default_rng([seed, 1])  # apart from the pictures' stream: their poses stay those of square
    out = []
    for _ in range(count):
        aspect = MIXED_ASPECTS[int(rng.integers(len(MIXED_ASPECTS)))]
        side = size * rng.uniform(1.25, 1.75)
        out.append((round(side * math.sqrt(aspect)), round(side / math.sqrt(aspect))))
    return out


def make_dataset(
    out: Path,
    count: int = 5,
    size: int = 128,
    seed: int = 0,
    captions: str | None = None,
    token: str = "<dicoo>",
    sizes: str = "square",
    pairs: bool = False,
) -> list[Path]:
    """Write ``count`` synthetic pictures of one small object (a yellow toy robot) in different poses, all
    ``size`` x ``size`` or, with ``sizes="mixed"``, of mixed sizes and aspect ratios (:func:`image_sizes`).

    With ``captions`` (``metadata``: metadata.jsonl, ``sidecar``: a .txt beside each image, ``txt``:
    captions.txt), each image gets a caption that names the concept's ``token`` and the background's colour,
    e.g. ``a photo of a <dicoo> on a red background``. ``pairs``: image pairs for edit training instead
    (:func:`make_pairs`, captioned with their instruction)."""
    if count < 1:
        raise ValueError("make-dataset needs --count >= 1")
    if pairs:
        if captions is not None or sizes != "square":
            raise ValueError(
                "make-dataset --pairs writes square pairs captioned with their instruction: leave out "
                "--captions and --sizes"
            )
        return sorted(make_pairs(out, count, size).glob("*.png"))  # the training images (the references: ref/)
    if captions is not None and captions not in CAPTION_LAYOUTS:
        raise ValueError(f"unknown --captions {captions!r}; choose one of {', '.join(CAPTION_LAYOUTS)}")
    dims = image_sizes(count, size, sizes, seed)
    digits = max(2, len(str(count - 1)))
    rng = np.random.default_rng(seed)
    out = Path(out)
    paths = []
    texts = []
    with atomic_dir(out) as tmp:
        for i, (width, height) in enumerate(dims):
            bg = tuple(int(v) for v in rng.integers(40, 200, size=3))
            img = Image.new("RGB", (width, height), bg)
            d = ImageDraw.Draw(img)
            s = min(width, height) / 128
            cx = width / 2 + rng.uniform(-12, 12) * s
            cy = height / 2 + rng.uniform(-8, 8) * s
            angle = rng.uniform(-0.4, 0.4)
            w, h = 44 * s, 50 * s
            body = [
                (
                    cx + dx * math.cos(angle) - dy * math.sin(angle),
                    cy + dx * math.sin(angle) + dy * math.cos(angle),
                )
                for dx, dy in ((-w / 2, -h / 2), (w / 2, -h / 2), (w / 2, h / 2), (-w / 2, h / 2))
            ]
            d.polygon(body, fill=(235, 200, 40), outline=(40, 40, 40))
            head_r = 14 * s
            hx, hy = cx + math.sin(angle) * h * 0.8, cy - math.cos(angle) * h * 0.8
            d.ellipse(
                [hx - head_r, hy - head_r, hx + head_r, hy + head_r],
                fill=(245, 215, 60),
                outline=(40, 40, 40),
            )
            for ex in (-5, 5):
                d.ellipse([hx + ex * s - 2 * s, hy - 2 * s, hx + ex * s + 2 * s, hy + 2 * s], fill=(20, 20, 20))
            name = f"dicoo_{i:0{digits}d}.png"
            img.save(tmp / name)
            paths.append(out / name)
            texts.append(f"a photo of a {token} on a {_COLOURS[int(np.argmax(bg))]} background")
        if captions == "metadata":
            lines = [json.dumps({"file_name": p.name, "text": t}) for p, t in zip(paths, texts, strict=True)]
            (tmp / "metadata.jsonl").write_text("\n".join(lines) + "\n")
        elif captions == "sidecar":
            for p, t in zip(paths, texts, strict=True):
                (tmp / p.with_suffix(".txt").name).write_text(t + "\n")
        elif captions == "txt":
            (tmp / "captions.txt").write_text("\n".join(texts) + "\n")
    log.info("wrote %d %s images to %s%s", count, sizes, out, f" with captions ({captions})" if captions else "")
    return paths


PAIRS_PROMPT = "turn the red square blue"


def make_pairs(out: Path, count: int = 5, size: int = 64, prompt: str = PAIRS_PROMPT) -> Path:
    """Write ``count`` image pairs for edit training (``--cond_image_column cond_image``): each training image a
    blue square on black, ``size`` x ``size``, its reference in ``ref/`` the same square red, and metadata.jsonl
    naming both with the instruction ``prompt`` (``file_name``, ``text``, ``cond_image``). The squares
    move from one pair to the next (at 64 px: 24 px squares, 5 px down and 3 px right each)."""
    if count < 1:
        raise ValueError("make-dataset --pairs needs --count >= 1")
    if size < 64:
        raise ValueError(f"make-dataset --pairs needs --size >= 64 (got {size})")
    digits = max(1, len(str(count - 1)))
    out = Path(out)
    rows = []
    with atomic_dir(out) as tmp:
        (tmp / "ref").mkdir()
        for i in range(count):
            top, left = (12 + 5 * (i % 6)) * size // 64, (14 + 3 * (i % 6)) * size // 64
            side = 24 * size // 64
            square = (slice(top, top + side), slice(left, left + side))
            a = np.zeros((size, size, 3), np.uint8)
            a[square] = (230, 30, 30)
            name = f"p{i:0{digits}d}.png"
            Image.fromarray(a).save(tmp / "ref" / name)
            a[square] = (30, 30, 230)
            Image.fromarray(a).save(tmp / name)
            rows.append({"file_name": name, "text": prompt, "cond_image": f"ref/{name}"})
        (tmp / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    log.info("wrote %d image pairs of %d px to %s", count, size, out)
    return out
