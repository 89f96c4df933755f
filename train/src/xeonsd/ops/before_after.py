"""The report's first picture and the model card's: the base model before training against the trained result, at
the same seeds, each row with its distance to the training images.

``images/`` holds the after row (``xeonsd generate`` with the run's result: the prompt with the concept's token),
``images/before/`` the before row (the base model without the result, the prompt with the word the concept started
from; export.yml's openvino_export role draws both). Each row's number is :func:`xeonsd.ops.likeness.distance` to
the images in train_summary.json's ``data_dir``: lower is closer to the concept.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from xeonsd.fsutil import atomic_file
from xeonsd.modelfiles.modelsource import model_fingerprint
from xeonsd.ops.likeness import distance, training_images

BEFORE_DIR = "images/before"
AFTER_DIR = "images"
GRID = "grid.png"
PICTURE = "before_after.png"  # both rows in one picture, beside report.html (the model card's and the README's)
SAME = 0.05  # a ratio within 5 % of 1 is no visible change (seeds and engines differ by about that much)
# xeonsd.assets.demo_model.SHIPPED, which ops may not import (xeonsd.ops's layering: tests/xeonsd/test_imports.py)
DEMO_MODEL = Path(__file__).resolve().parents[1] / "assets" / "demo_model"
SIDE = 128  # each picture's side in it, at least (the demo's 64 px pictures are scaled up, pixels kept sharp)
DEMO_NOTE = (
    "the demo's pretrained model (xeonsd/assets/demo_model): a small SD 1.x pipeline of our own, pretrained at 64 px "
    "on simple captioned scenes (toys of four shapes and colours on grass, at the beach or on snow), so its pictures "
    "are small and simple"
)


@dataclass(frozen=True)
class Row:
    """One row: its images (paths relative to the run directory), prompt, engine, seeds and distance."""

    label: str
    images: list[str]
    prompt: str
    engine: str
    seeds: list[int]
    distance: float | None


@dataclass(frozen=True)
class BeforeAfter:
    before: Row
    after: Row

    @property
    def ratio(self) -> float | None:
        """after ÷ before: under 1 when training brought the pictures closer to the concept."""
        if self.before.distance is None or self.after.distance is None or self.before.distance == 0:
            return None
        return self.after.distance / self.before.distance


def pictures(run: Path, rel: str) -> list[str]:
    """The PNGs a ``xeonsd generate --out`` directory holds (its grid left out), relative to ``run``, in name order."""
    folder = run / rel
    if not folder.is_dir():
        return []
    return [f"{rel}/{p.name}" for p in sorted(folder.glob("*.png")) if p.name != GRID]


def _row(run: Path, label: str, rel: str, refs: list | None) -> Row | None:
    images = pictures(run, rel)
    if not images:
        return None
    try:
        timings = json.loads((run / rel / "timings.json").read_text())
    except (OSError, json.JSONDecodeError):
        timings = {}
    prompts = timings.get("prompts") or [timings.get("prompt", "")]
    from PIL import Image

    far = distance([Image.open(run / p) for p in images], refs) if refs else None
    return Row(label, images, str(prompts[0]), str(timings.get("engine", "")), list(timings.get("seeds", [])), far)


def read(run: Path, summary: dict) -> BeforeAfter | None:
    """The two rows of RUN, when both were drawn; the distances when the training images are still at ``data_dir``."""
    run = Path(run)
    data_dir = summary.get("data_dir")
    refs = training_images(Path(data_dir)) if data_dir and Path(data_dir).is_dir() else None
    before = _row(run, "before", BEFORE_DIR, refs)
    after = _row(run, "after", AFTER_DIR, refs) if before is not None else None
    if before is None or after is None:
        return None
    return BeforeAfter(before, after)


@cache
def _demo_fingerprint() -> str:
    return model_fingerprint(str(DEMO_MODEL))


def demo_base(summary: dict) -> bool:
    """Whether the run's base model is the demo's pretrained one (by train_summary.json's fingerprint)."""
    return bool(summary.get("base_model_fingerprint")) and summary["base_model_fingerprint"] == _demo_fingerprint()


def verdict(pair: BeforeAfter) -> str:
    """One sentence with the two distances and their ratio, or why there are none."""
    if pair.ratio is None:
        return "The training images were not found on this host, so the rows are not measured against them."
    if pair.ratio <= 1 - SAME:
        moved = "the trained model draws closer to the concept"
    elif pair.ratio >= 1 + SAME:
        moved = "the trained model draws farther from the concept than the base model"
    else:
        moved = f"the pictures moved less than {SAME:.0%} toward the concept: this run did not learn it visibly"
    return (
        f"Distance to the nearest training image (RMS of 16×16 pixels, 0-1; lower is closer): before "
        f"{pair.before.distance:.3f}, after {pair.after.distance:.3f} ({pair.ratio:.2f}×): {moved}."
    )


def section(pair: BeforeAfter) -> str:
    """The report's "Before and after" section: both rows, their prompts and engines, and the verdict."""
    parts = []
    for row in (pair.before, pair.after):
        figs = "".join(
            f'<figure><img src="{html.escape(p)}" alt="{row.label} {i + 1}"><figcaption>#{i + 1}</figcaption></figure>'
            for i, p in enumerate(row.images)
        )
        far = f"; distance {row.distance:.3f}" if row.distance is not None else ""
        seeds = f", seed {', '.join(map(str, row.seeds))}" if row.seeds else ""
        what = "the base model, without the result" if row.label == "before" else "with the trained result"
        parts.append(
            f"<h3>{row.label.capitalize()}: <q>{html.escape(row.prompt)}</q></h3>"
            f"<p>{what} ({html.escape(row.engine)}{seeds}{far})</p><div class=images>{figs}</div>"
        )
    return f"<h2>Before and after</h2><p>{html.escape(verdict(pair))}</p>{''.join(parts)}"


def write_picture(run: Path, pair: BeforeAfter) -> Path:
    """RUN/before_after.png: the before row over the after row, each picture at least SIDE pixels wide, a white gap
    between them."""
    from PIL import Image

    rows = [[Image.open(Path(run) / p).convert("RGB") for p in row.images] for row in (pair.before, pair.after)]
    w, h = rows[0][0].size
    scale = max(1, -(-SIDE // w))
    w, h, gap = w * scale, h * scale, 4
    cols = max(len(r) for r in rows)
    out = Image.new("RGB", (cols * w + (cols - 1) * gap, 2 * h + gap), "white")
    for y, row in enumerate(rows):
        for x, im in enumerate(row):
            out.paste(im.resize((w, h), Image.NEAREST), (x * (w + gap), y * (h + gap)))
    with atomic_file(Path(run) / PICTURE, "wb") as fh:
        out.save(fh, format="PNG")
    return Path(run) / PICTURE
