"""Captions of the training images, from the three layouts users bring, looked for in this order:

1. ``metadata.jsonl``: the Hugging Face image-folder layout, one JSON object per line with ``file_name`` and a
   caption column (``--caption_column``, default ``text``);
2. sidecar files: ``object_01.txt`` beside ``object_01.jpg`` (the common LoRA-trainer layout);
3. ``captions.txt``: one line per image, the images taken in sorted file-name order (the recipe's layout).

Every image must have exactly one non-empty caption; anything else is a :class:`~xeonsd.trainer.data.DataError` that
names the image, the line or both counts.

What a training example sees of its caption is :class:`CaptionDraws`' choice: ``--caption_dropout`` (the empty
caption), ``--shuffle_tags`` with ``--keep_tokens`` (the comma-separated tags shuffled, the first N in place) and
``--caption_prefix`` (put in front). Like every draw of the sampling plan it is a function of the seed and the
example's global index only (its own stream), so world size and resume do not change it; validation sees the
caption with its prefix and nothing drawn (:meth:`CaptionDraws.fixed`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from xeonsd.trainer.data import DataError
from xeonsd.trainer.rng import Stream, generator

METADATA = "metadata.jsonl"
CAPTIONS_TXT = "captions.txt"
SIDECAR_SUFFIX = ".txt"


@dataclass(frozen=True)
class Captions:
    """One caption per training image (same order as the images), and where they came from."""

    texts: tuple[str, ...]
    source: str  # a file name, or "sidecar .txt files"
    where: tuple[str, ...]  # for each caption, the file (and line) it was read from, for error messages


def read_captions(data_dir: Path, images: list[Path], column: str = "text") -> Captions | None:
    """The captions of ``images`` (sorted, all in ``data_dir``), or None when the directory has none."""
    data_dir = Path(data_dir)
    if (data_dir / METADATA).is_file():
        return _from_metadata(data_dir / METADATA, images, column)
    sidecars = [p.with_suffix(SIDECAR_SUFFIX) for p in images]
    if any(s.is_file() for s in sidecars):
        return _from_sidecars(images, sidecars)
    if (data_dir / CAPTIONS_TXT).is_file():
        return _from_lines(data_dir / CAPTIONS_TXT, images)
    return None


def read_references(data_dir: Path, images: list[Path], column: str, most: int = 1) -> dict[Path, tuple[Path, ...]]:
    """Each image's reference images for edit training: ``column`` of its metadata.jsonl row, a path relative to
    ``data_dir`` or a list of such paths (the layout of diffusers' img2img scripts' ``--cond_image_column`` as an
    image folder; a list as a datasets ``Sequence(Image)`` column). Every image has the same number of them, 1 to
    ``most`` (what the family's pipeline takes), each decoding, inside ``data_dir`` and not itself a training image;
    a DataError names what is not."""
    data_dir = Path(data_dir)
    path = data_dir / METADATA
    if not path.is_file():
        raise DataError(
            f"--cond_image_column {column}: {data_dir} has no {METADATA}; edit training reads each image's reference "
            f'image from it (one line per image: {{"file_name": "a.png", "text": "...", "{column}": "ref/a.png"}})'
        )
    rows: dict[str, tuple[object, str]] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{n}: not a JSON object ({exc.msg})") from exc
            if isinstance(row, dict) and "file_name" in row:
                rows[Path(str(row["file_name"])).name] = (row.get(column), f"{path}:{n}")
    names = {p.resolve() for p in images}
    out: dict[Path, tuple[Path, ...]] = {}
    for image in images:
        value, where = rows.get(image.name, (None, str(path)))
        values = value if isinstance(value, list) else [value]
        if not values or not all(isinstance(v, str) and v.strip() for v in values):
            raise DataError(
                f"{where}: no reference image for {image.name} (the {column!r} field: a relative path, or a list "
                "of them)"
            )
        if len(values) > most:
            raise DataError(
                f"{where}: {len(values)} reference images for {image.name}; this model takes at most {most}"
            )
        first = next(iter(out.values()), None)
        if first is not None and len(values) != len(first):
            raise DataError(
                f"{where}: {len(values)} reference image(s) for {image.name}, {len(first)} for {images[0].name}; "
                "every training image needs the same number (a batch stacks them)"
            )
        out[image] = tuple(_reference(data_dir, str(v), image, where, names) for v in values)
    return out


def _reference(data_dir: Path, value: str, image: Path, where: str, names: set[Path]) -> Path:
    """The reference image ``value`` of ``image``, checked: inside ``data_dir``, not a training image, decoding."""
    from PIL import Image, UnidentifiedImageError

    ref = (data_dir / value).resolve()
    if not ref.is_relative_to(data_dir.resolve()):
        raise DataError(f"{where}: the reference image {value!r} of {image.name} is outside {data_dir}")
    if ref in names:
        raise DataError(
            f"{where}: the reference image {value!r} of {image.name} is a training image; keep the reference "
            "images in a folder of their own (e.g. ref/)"
        )
    try:
        with Image.open(ref) as im:
            im.load()
    except (OSError, UnidentifiedImageError) as exc:
        raise DataError(f"{where}: cannot read the reference image {value!r} of {image.name}: {exc}") from exc
    return ref


def _check_text(text: object, where: str) -> str:
    if not isinstance(text, str):
        raise DataError(f"{where}: the caption is not a string ({type(text).__name__})")
    text = " ".join(text.split())
    if not text:
        raise DataError(f"{where}: the caption is empty")
    return text


def _from_metadata(path: Path, images: list[Path], column: str) -> Captions:
    by_name: dict[str, tuple[str, str]] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not a JSON object ({exc.msg})") from exc
        if not isinstance(row, dict) or "file_name" not in row:
            raise DataError(f"{where}: no 'file_name' field")
        if column not in row:
            fields = ", ".join(sorted(k for k in row if k != "file_name")) or "none"
            raise DataError(
                f"{where}: no caption column {column!r} (fields: {fields}; choose one with --caption_column)"
            )
        name = Path(str(row["file_name"])).name
        if name in by_name:
            raise DataError(f"{where}: {name} already has a caption on line {by_name[name][1].rsplit(':', 1)[1]}")
        by_name[name] = (_check_text(row[column], where), where)
    known = {p.name for p in images}
    strays = sorted(set(by_name) - known)
    if strays:
        raise DataError(f"{path}: captions for images that are not in {path.parent}: {', '.join(strays[:5])}")
    missing = [p.name for p in images if p.name not in by_name]
    if missing:
        raise DataError(
            f"{path}: no caption for image {missing[0]}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    texts = tuple(by_name[p.name][0] for p in images)
    return Captions(texts, METADATA, tuple(by_name[p.name][1] for p in images))


def _from_sidecars(images: list[Path], sidecars: list[Path]) -> Captions:
    missing = [img.name for img, s in zip(images, sidecars, strict=True) if not s.is_file()]
    if missing:
        raise DataError(
            f"image {missing[0]} has no caption file {Path(missing[0]).with_suffix(SIDECAR_SUFFIX).name} (the other "
            "images have one)" + (f"; {len(missing) - 1} more image(s) without one" if len(missing) > 1 else "")
        )
    texts = tuple(_check_text(s.read_text(encoding="utf-8"), str(s)) for s in sidecars)
    return Captions(texts, f"sidecar {SIDECAR_SUFFIX} files", tuple(str(s) for s in sidecars))


def _from_lines(path: Path, images: list[Path]) -> Captions:
    lines = path.read_text(encoding="utf-8").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if len(lines) != len(images):
        raise DataError(
            f"{path} has {len(lines)} caption line(s) but {path.parent} has {len(images)} image(s); it needs one "
            "line per image, in sorted file-name order"
        )
    where = tuple(f"{path}:{n} ({img.name})" for n, img in enumerate(images, start=1))
    texts = tuple(_check_text(line, w) for line, w in zip(lines, where, strict=True))
    return Captions(texts, CAPTIONS_TXT, where)


def split_tags(caption: str) -> list[str]:
    """The comma-separated tags of a caption, stripped, empty ones left out."""
    return [t.strip() for t in caption.split(",") if t.strip()]


@dataclass(frozen=True)
class CaptionDraws:
    """What each training example makes of its caption: a function of (seed, global example index) only."""

    seed: int = 0
    dropout: float = 0.0  # probability of the empty caption
    shuffle_tags: bool = False
    keep_tokens: int = 0  # with shuffle_tags: the first N tags stay in place
    prefix: str = ""  # put in front of every caption (after the shuffle; not with the empty caption)

    @classmethod
    def for_run(cls, cfg, seed: int) -> CaptionDraws:
        """The run's draws (--caption_dropout, --shuffle_tags, --keep_tokens, --caption_prefix)."""
        prefix = (cfg.caption_prefix or "").strip()
        return cls(seed, cfg.caption_dropout, cfg.shuffle_tags, cfg.keep_tokens, prefix)

    @property
    def varies(self) -> bool:
        """Whether an example can see anything but :meth:`fixed` of its caption."""
        return self.dropout > 0 or self.shuffle_tags

    def fixed(self, caption: str) -> str:
        """The caption as validation (and a run without draws) sees it: the prefix, nothing drawn."""
        return f"{self.prefix} {caption}" if self.prefix else caption

    def dropped(self, k: int) -> bool:
        """Whether example ``k`` trains on the empty caption (the first draw of its stream)."""
        return self.dropout > 0 and bool(
            torch.rand((), generator=generator(self.seed, Stream.CAPTIONS, k)) < self.dropout
        )

    def text(self, caption: str, k: int) -> str:
        """The caption example ``k`` trains on."""
        if not self.varies:
            return self.fixed(caption)
        g = generator(self.seed, Stream.CAPTIONS, k)
        if self.dropout > 0 and bool(torch.rand((), generator=g) < self.dropout):
            return ""
        if self.shuffle_tags:
            tags = split_tags(caption)
            kept, rest = tags[: self.keep_tokens], tags[self.keep_tokens :]
            order = torch.randperm(len(rest), generator=g).tolist()
            caption = ", ".join(kept + [rest[i] for i in order])
        return self.fixed(caption)


def short_tag_captions(captions: Captions, images: list[Path], keep_tokens: int) -> list[str]:
    """The images whose caption has fewer tags than ``--keep_tokens`` (all their tags stay in place)."""
    return [img.name for img, text in zip(images, captions.texts, strict=True) if len(split_tags(text)) < keep_tokens]
