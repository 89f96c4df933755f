"""``xeonsd train``'s command line, made from :class:`~xeonsd.trainer.config.TrainConfig`'s fields: the parser
(``--help`` groups the flags by method), the flags a command line gives explicitly, and parsing, which refuses a
flag of another method than ``--method`` by name."""

from __future__ import annotations

import argparse
import dataclasses

from xeonsd.contracts.method_names import PRIOR_NEEDS_WEIGHTS
from xeonsd.flags import add_flags, from_args
from xeonsd.trainer.config import FULL, LORA, TI, ConfigError, TrainConfig

# --help's groups: the flags of every method, then each method's own (a field's ``methods``)
GROUPS = (
    ((), "all methods"),
    ((TI,), "textual inversion (--method textual_inversion)"),
    ((LORA, FULL), "LoRA and full fine-tuning"),
    ((LORA,), "LoRA (--method lora)"),
    ((FULL,), "full fine-tuning of the UNet (--method full)"),
)


def flag_methods(name: str) -> tuple[str, ...]:
    """The methods a TrainConfig field belongs to (empty: all)."""
    return next(f.metadata["methods"] for f in dataclasses.fields(TrainConfig) if f.name == name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xeonsd train",
        description="Fine-tune a Stable Diffusion model on Xeon CPUs, distributed over MPI ranks: textual inversion "
        "(the recipe's, default), LoRA or the full UNet, on prompt templates, an instance prompt or captions.",
        allow_abbrev=False,
    )
    groups = {methods: parser.add_argument_group(title) for methods, title in GROUPS}
    add_flags(parser, TrainConfig, group=lambda f: groups[f.metadata["methods"]])
    return parser


def given_flags(argv: list[str]) -> set[str]:
    """The field names that ``argv`` sets explicitly (``--name``, ``--name=v``, ``--no-name``)."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    aliases = {a[2:]: f.name for f in dataclasses.fields(TrainConfig) for a in f.metadata.get("aliases", ())}
    given = set()
    for arg in argv:
        if not arg.startswith("--"):
            continue
        name = arg[2:].split("=", 1)[0]
        name = name[3:] if name.startswith("no-") and name[3:] in fields else name
        name = aliases.get(name, name)
        if name in fields:
            given.add(name)
    return given


def parse_config(argv: list[str]) -> TrainConfig:
    """Parse ``argv``; a flag of another method than the chosen one is a ConfigError naming it."""
    args = build_parser().parse_args(argv)
    cfg = from_args(TrainConfig, args)
    foreign = sorted(n for n in given_flags(argv) if flag_methods(n) and cfg.method not in flag_methods(n))
    if "with_prior_preservation" in foreign:  # refused with its reason, not only as another method's flag
        raise ConfigError(PRIOR_NEEDS_WEIGHTS)
    if foreign:
        owners = {n: "/".join(flag_methods(n)) for n in foreign}
        raise ConfigError(
            f"--method {cfg.method} does not use "
            + ", ".join(f"--{n} (a {owners[n]} flag)" for n in foreign)
            + "; remove it or choose that --method"
        )
    return cfg
