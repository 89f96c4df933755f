"""xeonsd.flags: an options dataclass makes its command line, and the parsed line makes the dataclass back."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest

from xeonsd.flags import add_flags, flag, from_args


def _pair(spec: str) -> tuple[Path, float]:
    path, _, alpha = spec.partition(":")
    return Path(path), float(alpha or 1)


@dataclass(frozen=True)
class Options:
    src: Path = flag("where from", positional=True)
    steps: int = flag("steps (no default: required)")
    num_images: int = flag("images", default=5)
    scale: float | None = flag("scale", default=None)
    engine: str = flag("engine", default="optimum", cli_default="genai", choices=("optimum", "genai"))
    pairs: tuple[tuple[Path, float], ...] = flag("pair", default=(), name="--pair", action="append", convert=_pair)
    fast: bool = flag("go fast", default=True, negatable=True)
    quiet: bool = flag("say less", default=False)


def _parse(argv: list[str], dashes: bool = True) -> Options:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_flags(p, Options, dashes=dashes)
    return from_args(Options, p.parse_args(argv))


def test_the_fields_make_the_flags_and_the_parsed_line_makes_the_options() -> None:
    opts = _parse(["in", "--steps", "3", "--num-images", "2", "--pair", "a:0.5", "--pair", "b", "--no-fast"])
    assert opts == Options(
        src=Path("in"), num_images=2, engine="genai", pairs=((Path("a"), 0.5), (Path("b"), 1.0)), fast=False, steps=3
    )
    assert _parse(["in", "--steps=1", "--scale", "0.5", "--quiet"]).scale == 0.5
    assert _parse(["in", "--num_images", "4", "--steps", "1"], dashes=False).num_images == 4


def test_a_flag_left_out_keeps_the_field_default_or_the_cli_default() -> None:
    opts = _parse(["in", "--steps", "1"])
    assert (opts.num_images, opts.scale, opts.pairs, opts.fast, opts.quiet) == (5, None, (), True, False)
    assert opts.engine == "genai"  # the command line's default; the Python API's stays optimum
    assert Options(src=Path("x"), steps=1).engine == "optimum"


def test_bad_input_is_refused_by_name() -> None:
    with pytest.raises(SystemExit):  # argparse: "the following arguments are required: --steps"
        _parse(["in"])
    with pytest.raises(argparse.ArgumentError, match="--engine"):
        _parse(["in", "--steps", "1", "--engine", "other"])
    with pytest.raises(argparse.ArgumentError, match="--num-images"):
        _parse(["in", "--steps", "1", "--num-images", "many"])
    with pytest.raises(TypeError, match="mutable default"):
        flag("a list", default=[1])
