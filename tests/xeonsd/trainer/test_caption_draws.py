"""The caption draws of a training example: --caption_dropout, --shuffle_tags with --keep_tokens, --caption_prefix.
Each a function of (seed, global example index) only; nothing drawn for validation; refused where they cannot
apply. A tiny LoRA run with all of them on, whose shuffled captions go through the frozen text encoder per step."""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter
from pathlib import Path

import pytest
from cli_runs import method_args, train

from xeonsd.trainer.argv import parse_config
from xeonsd.trainer.captions import CaptionDraws, read_captions, split_tags
from xeonsd.trainer.config import ConfigError
from xeonsd.trainer.data import SamplingPlan, find_images
from xeonsd.trainer.inputs import check_caption_options

TAGS = "sks, red ball, grass, sunny, photo"


def test_split_tags_strips_and_drops_empty_tags() -> None:
    assert split_tags(" sks,red ball , ,grass,") == ["sks", "red ball", "grass"]
    assert split_tags("a photo of a dog") == ["a photo of a dog"]


def test_shuffle_keeps_the_first_n_tags_in_place_and_permutes_the_rest() -> None:
    draws = CaptionDraws(seed=7, shuffle_tags=True, keep_tokens=2)
    seen = Counter()
    for k in range(600):
        tags = draws.text(TAGS, k).split(", ")
        assert tags[:2] == ["sks", "red ball"]
        assert sorted(tags[2:]) == ["grass", "photo", "sunny"]
        seen[tuple(tags[2:])] += 1
    # all 3! = 6 orders of the other three, each about 1/6 of the time (100 ± 4 sigma = ±37)
    assert len(seen) == 6 and all(63 <= n <= 137 for n in seen.values()), seen
    # keep_tokens 0: the first tag moves too; as many as there are tags (or more): nothing moves
    assert {CaptionDraws(seed=7, shuffle_tags=True).text(TAGS, k).split(", ")[0] for k in range(50)} == set(
        split_tags(TAGS)
    )
    for keep in (5, 9):
        assert all(CaptionDraws(seed=7, shuffle_tags=True, keep_tokens=keep).text(TAGS, k) == TAGS for k in range(20))
    assert CaptionDraws(seed=7, shuffle_tags=True).text("a, b", 3) in ("a, b", "b, a")


def test_each_draw_is_a_function_of_seed_and_example_index_only() -> None:
    a = CaptionDraws(seed=7, dropout=0.3, shuffle_tags=True, keep_tokens=1)
    texts = [a.text(TAGS, k) for k in range(200)]
    assert texts == [
        CaptionDraws(seed=7, dropout=0.3, shuffle_tags=True, keep_tokens=1).text(TAGS, k) for k in range(200)
    ]
    assert texts != [
        CaptionDraws(seed=8, dropout=0.3, shuffle_tags=True, keep_tokens=1).text(TAGS, k) for k in range(200)
    ]
    # whichever rank draws an example: 2 ranks x batch 2 see the captions 1 rank x batch 4 sees
    plan = SamplingPlan(seed=7, num_images=5, num_templates=1, num_timesteps=1000, latent_shape=(4, 2, 2))
    one = plan.batch(3, 0, 1, 1, 0, 4)
    two = plan.batch(3, 0, 1, 2, 0, 2) + plan.batch(3, 0, 1, 2, 1, 2)
    assert [a.text(TAGS, e.index) for e in one] == [a.text(TAGS, e.index) for e in two]
    # the empty caption is the first draw: turning the shuffle on does not change which examples drop
    drop_only = CaptionDraws(seed=7, dropout=0.3)
    assert [t == "" for t in texts] == [drop_only.dropped(k) for k in range(200)]
    assert [drop_only.text(TAGS, k) for k in range(200)] == ["" if drop_only.dropped(k) else TAGS for k in range(200)]


def test_dropout_drops_that_fraction_and_off_draws_nothing() -> None:
    draws = CaptionDraws(seed=11, dropout=0.3)
    rate = sum(draws.dropped(k) for k in range(4000)) / 4000
    assert abs(rate - 0.3) < 0.03, rate  # binomial sigma 0.0072: 4 sigma
    off = CaptionDraws(seed=11)
    assert not off.varies and not any(off.dropped(k) for k in range(100))
    assert all(off.text(TAGS, k) == TAGS for k in range(100))


def test_the_prefix_goes_in_front_after_the_shuffle_and_validation_draws_nothing() -> None:
    draws = CaptionDraws(seed=7, dropout=0.5, shuffle_tags=True, prefix="zwx")
    texts = [draws.text("a, b, c", k) for k in range(100)]
    assert {t for t in texts if t} == {f"zwx {', '.join(p)}" for p in _perms("a", "b", "c")}
    assert "" in texts  # the empty caption has no prefix either
    assert draws.fixed("a, b, c") == "zwx a, b, c"  # what validation sees
    assert CaptionDraws(prefix="zwx").text("a dog", 4) == "zwx a dog"


def _perms(*xs: str) -> list[tuple[str, ...]]:
    from itertools import permutations

    return list(permutations(xs))


# ---- the flags, checked before a model loads -----------------------------------------------------------------------


def _cfg(method: str, *extra: str, data: Path = Path("d")):
    return parse_config(method_args(method, Path("m"), data, Path("o"), *extra))


@pytest.fixture
def tagged(dataset: Path, tmp_path: Path) -> Path:
    """The 5 images with tag captions in captions.txt; the last one has only two tags."""
    data = tmp_path / "tagged"
    shutil.copytree(dataset, data)
    lines = [f"sks, toy, tag{i}, bright" for i in range(4)] + ["sks, toy"]
    (data / "captions.txt").write_text("\n".join(lines) + "\n")
    return data


def test_bad_caption_flags_are_refused_naming_the_flag(tagged: Path) -> None:
    images = find_images(tagged)
    caps = read_captions(tagged, images)
    cases = {
        ("--caption_dropout=1",): "--caption_dropout is a probability in [0, 1)",
        ("--caption_dropout=-0.1",): "--caption_dropout is a probability in [0, 1)",
        ("--keep_tokens=-1", "--shuffle_tags"): "--keep_tokens must be 0 or more",
        ("--keep_tokens=1",): "--keep_tokens keeps tags in place when --shuffle_tags shuffles them",
    }
    for extra, message in cases.items():
        cfg = _cfg("lora", *extra, data=tagged)
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(")", r"\)")):
            check_caption_options(cfg, images, caps, True, True)
    # the caption flags on a run without captions
    cfg = _cfg("lora", "--instance_prompt=a sks toy", "--captions=off", "--shuffle_tags", "--caption_prefix=z")
    with pytest.raises(
        ConfigError,
        match="--shuffle_tags and --caption_prefix work on captions, but this run trains on --instance_prompt",
    ):
        check_caption_options(cfg, images, None, False, True)
    cfg = _cfg("textual_inversion", "--shuffle_tags")
    with pytest.raises(
        ConfigError, match="--shuffle_tags work on captions, but this run trains on the prompt templates"
    ):
        check_caption_options(cfg, images, None, False, True)
    # dropout with an instance prompt is fine (the empty caption is the same for every image)
    check_caption_options(_cfg("lora", "--instance_prompt=x", "--caption_dropout=0.1"), images, None, False, True)


@pytest.mark.parametrize("flag", ["--caption_dropout=0.1", "--caption_prefix=sks"])
def test_textual_inversion_refuses_dropout_and_prefix(flag: str) -> None:
    """An empty caption has no placeholder (nothing for the vectors to learn), and the placeholder is the trigger."""
    with pytest.raises(
        ConfigError, match=rf"--method textual_inversion does not use --{flag[2:].split('=')[0]} \(a lora/full flag\)"
    ):
        _cfg("textual_inversion", flag)


def test_keep_tokens_past_an_images_tags_warns_naming_it(tagged: Path, caplog: pytest.LogCaptureFixture) -> None:
    images = find_images(tagged)
    cfg = _cfg("lora", "--shuffle_tags", "--keep_tokens=3", data=tagged)
    with caplog.at_level(logging.WARNING, logger="xeonsd.train"):
        check_caption_options(cfg, images, read_captions(tagged, images), True, True)
    assert [r.getMessage() for r in caplog.records] == [
        f"--keep_tokens 3: 1 image(s) have fewer tags, all of theirs stay in place: {images[-1].name}"
    ]


# ---- a run ---------------------------------------------------------------------------------------------------------


def test_a_lora_run_with_every_caption_option_finishes_and_records_them(tiny_model, tagged, tmp_path, cli_env) -> None:
    out = tmp_path / "out"
    flags = ("--caption_dropout=0.25", "--shuffle_tags", "--keep_tokens=3", "--caption_prefix=zwx")
    proc = train(method_args("lora", tiny_model, tagged, out, *flags, steps=2, batch=2), cli_env)
    assert "1 image(s) have fewer tags" in proc.stderr
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["prompts"] == {
        "source": "captions.txt",
        "count": 5,
        "per_image": True,
        "caption_dropout": 0.25,
        "shuffle_tags": True,
        "keep_tokens": 3,
        "caption_prefix": "zwx",
    }
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert [r for r in rows if "loss" in r] and all(r["loss"] == r["loss"] for r in rows if "loss" in r)
