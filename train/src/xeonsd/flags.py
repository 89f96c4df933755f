"""One pattern for every command line: the options dataclass is the CLI.

Each field of a command's options dataclass carries its flag (:func:`flag`: the help, and where needed a name, a
CLI default, a conversion); :func:`add_flags` builds the argparse arguments from the fields and their type hints,
and :func:`from_args` turns the parsed namespace back into the dataclass, so no command copies its arguments into
its options one by one. Standard library only: building a parser imports nothing heavy.

Flag names: ``xeonsd train``'s flags are its fields' names verbatim, with underscores (``--max_train_steps``), as
the seed recipe (diffusers' ``textual_inversion.py``) spells them, so the recipe's command line runs unchanged;
``xeonsd export``, ``generate`` and ``serve`` spell them with dashes (``--num-images`` for the field
``num_images``: ``add_flags(..., dashes=True)``), as most command lines do. Within one command there is one
spelling; an alias (``aliases=("--dry-run",)``) is only for a name users already type.

Use::

    @dataclass(frozen=True)
    class Options:
        steps: int = flag("denoising steps", default=20)
        prompts: tuple[str, ...] = flag("prompt (repeat for several)", default=("a cat",), name="--prompt",
                                        action="append")
        engine: str = flag("which engine", default="optimum", cli_default="genai", choices=("optimum", "genai"))

    parser = argparse.ArgumentParser()
    add_flags(parser, Options, dashes=True)  # --steps, --prompt (args.prompt), --engine
    opts = from_args(Options, parser.parse_args(argv))

The type hint gives the argparse type (``int | None`` -> ``int``; ``Path``); a ``bool`` is a bare flag
(``negatable=True``: also ``--no-NAME``; with a None default, three-way: True, False or None when left out); a
field without a default is required (``positional=True``: a positional argument). A flag left out, or given as
None, leaves the field's default (``cli_default``: what the command line uses instead, where the Python API's default
differs); ``action="append"`` collects a tuple; ``convert`` maps each given value (e.g. ``FILE[:ALPHA]`` -> ``(Path, float)``) after parsing. Other keyword arguments go to argparse
(``choices``, ``metavar``); ``meta`` holds a command's own data (the trainer's ``methods``).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any

_UNSET: Any = dataclasses.MISSING


def flag(
    help: str,
    *,
    default: Any = _UNSET,
    name: str | None = None,
    aliases: tuple[str, ...] = (),
    positional: bool = False,
    negatable: bool = False,
    cli_default: Any = _UNSET,
    convert: Callable[[Any], Any] | None = None,
    meta: dict[str, Any] | None = None,
    **argparse_kw: Any,
) -> Any:
    """A dataclass field that is also a command-line flag (see the module's docstring)."""
    metadata = {
        **(meta or {}),
        "help": help,
        "name": name,
        "aliases": aliases,
        "positional": positional,
        "negatable": negatable,
        "cli_default": cli_default,
        "convert": convert,
        "argparse": argparse_kw,
    }
    if isinstance(default, (list, dict, set)):
        raise TypeError(f"flag {name or help!r}: a mutable default {default!r}; use a tuple")
    if default is _UNSET:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _base_type(hint: Any) -> Any:
    """``int | None`` -> ``int``; anything else as it is."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return hint


def flag_name(f: dataclasses.Field, dashes: bool = False) -> str:
    """The option string of a field: its ``name``, else ``--`` and the field's name (dashed with ``dashes``)."""
    if f.metadata.get("name"):
        return f.metadata["name"]
    return "--" + (f.name.replace("_", "-") if dashes else f.name)


def _dest(f: dataclasses.Field) -> str:
    """The namespace attribute: the field's name, or the one its ``name`` makes (``--prompt``: ``prompt``)."""
    return f.metadata["name"].lstrip("-").replace("-", "_") if f.metadata.get("name") else f.name


def flag_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are flags (made by :func:`flag`)."""
    return [f for f in dataclasses.fields(cls) if "argparse" in f.metadata]


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    dashes: bool = False,
    group: Callable[[dataclasses.Field], Any] | None = None,
) -> None:
    """Add one argument per flag field of ``cls`` to ``parser`` (or to ``group(field)``, an argument group)."""
    hints = typing.get_type_hints(cls)
    for f in flag_fields(cls):
        meta = f.metadata
        target = group(f) if group is not None else parser
        kwargs: dict[str, Any] = {"help": meta["help"], **meta["argparse"]}
        default = f.default if meta["cli_default"] is _UNSET else meta["cli_default"]
        base = _base_type(hints[f.name])
        if meta["positional"]:
            target.add_argument(f.name, type=base, **kwargs)
            continue
        names = (flag_name(f, dashes), *meta["aliases"])
        kwargs["dest"] = _dest(f)
        if base is bool:
            action = argparse.BooleanOptionalAction if meta["negatable"] else "store_true"
            # A negatable flag whose field defaults to None is three-way: --NAME, --no-NAME, or left to the field.
            keep_none = meta["negatable"] and default is None
            target.add_argument(*names, action=action, default=None if keep_none else bool(default), **kwargs)
            continue
        if kwargs.get("action") == "append":
            kwargs["default"] = None  # argparse appends to a given default; from_args restores the field's
        elif default is _UNSET:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        if "action" not in kwargs:
            kwargs.setdefault("type", base if callable(base) and base is not typing.Any else str)
        target.add_argument(*names, **kwargs)


def from_args(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """``cls`` made from the parsed ``args`` (what :func:`add_flags` added; None leaves the field's default) and
    ``given`` (fields that are not flags)."""
    values = dict(given)
    for f in flag_fields(cls):
        value = getattr(args, _dest(f))
        if value is None:
            continue
        convert = f.metadata["convert"] or (lambda v: v)
        values[f.name] = tuple(convert(v) for v in value) if isinstance(value, list) else convert(value)
    return cls(**values)
