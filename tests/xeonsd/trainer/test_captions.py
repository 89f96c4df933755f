"""Captions in the three layouts the trainer reads, and each way they can be wrong (pure file parsing, no model)."""

from __future__ import annotations

import json

import pytest

from xeonsd.assets import make_dataset
from xeonsd.trainer.captions import read_captions
from xeonsd.trainer.data import DataError, find_images


@pytest.mark.parametrize(
    "layout,source", [("metadata", "metadata.jsonl"), ("sidecar", "sidecar .txt files"), ("txt", "captions.txt")]
)
def test_each_layout_gives_one_caption_per_image_in_image_order(tmp_path, layout, source):
    data = tmp_path / "d"
    make_dataset(data, count=4, size=16, captions=layout)
    images = find_images(data)
    caps = read_captions(data, images)
    assert caps is not None and caps.source == source
    assert len(caps.texts) == 4
    assert all(t.startswith("a photo of a <dicoo> on a ") for t in caps.texts)
    # the same image set with the other layouts reads the same captions, in the same order
    ref = tmp_path / "ref"
    make_dataset(ref, count=4, size=16, captions="metadata")
    assert caps.texts == read_captions(ref, find_images(ref)).texts


def test_no_captions_is_none(tmp_path):
    data = tmp_path / "d"
    make_dataset(data, count=2, size=16)
    assert read_captions(data, find_images(data)) is None


def test_metadata_wins_over_the_other_layouts(tmp_path):
    data = tmp_path / "d"
    make_dataset(data, count=2, size=16, captions="txt")
    (data / "metadata.jsonl").write_text(
        "\n".join(json.dumps({"file_name": f"dicoo_0{i}.png", "text": f"caption {i}"}) for i in range(2))
    )
    assert read_captions(data, find_images(data)).texts == ("caption 0", "caption 1")


def test_metadata_caption_column(tmp_path):
    data = tmp_path / "d"
    make_dataset(data, count=2, size=16)
    (data / "metadata.jsonl").write_text(
        "\n".join(json.dumps({"file_name": f"dicoo_0{i}.png", "prompt": f"p {i}"}) for i in range(2))
    )
    assert read_captions(data, find_images(data), column="prompt").texts == ("p 0", "p 1")
    with pytest.raises(DataError, match=r"metadata.jsonl:1: no caption column 'text' \(fields: prompt"):
        read_captions(data, find_images(data))


def _error(data) -> str:
    with pytest.raises(DataError) as exc:
        read_captions(data, find_images(data))
    return str(exc.value)


def test_captions_txt_with_the_wrong_number_of_lines_names_both_counts(tmp_path):
    data = tmp_path / "d"
    make_dataset(data, count=3, size=16)
    (data / "captions.txt").write_text("one\ntwo\n")
    assert "has 2 caption line(s)" in _error(data) and "has 3 image(s)" in _error(data)


def test_an_image_without_a_sidecar_caption_is_named(tmp_path):
    data = tmp_path / "d"
    make_dataset(data, count=3, size=16, captions="sidecar")
    (data / "dicoo_01.txt").unlink()
    assert "dicoo_01.png has no caption file dicoo_01.txt" in _error(data)


def test_an_image_missing_from_metadata_is_named(tmp_path):
    data = tmp_path / "d"
    make_dataset(data, count=3, size=16, captions="metadata")
    lines = (data / "metadata.jsonl").read_text().splitlines()
    (data / "metadata.jsonl").write_text("\n".join(lines[:2]) + "\n")
    assert "no caption for image dicoo_02.png" in _error(data)


def test_metadata_for_an_unknown_image_and_bad_json_are_named(tmp_path):
    data = tmp_path / "d"
    make_dataset(data, count=1, size=16)
    (data / "metadata.jsonl").write_text('{"file_name": "other.png", "text": "x"}\n')
    assert "other.png" in _error(data)
    (data / "metadata.jsonl").write_text('{"file_name": "dicoo_00.png", "text": "x"}\n{oops\n')
    assert "metadata.jsonl:2: not a JSON object" in _error(data)


def test_an_empty_caption_is_named(tmp_path):
    data = tmp_path / "d"
    make_dataset(data, count=2, size=16)
    (data / "captions.txt").write_text("   \na photo\n")
    assert "captions.txt:1 (dicoo_00.png): the caption is empty" in _error(data)
