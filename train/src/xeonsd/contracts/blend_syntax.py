"""The LoRA blend syntax that ``serve.yml`` (``serve_blends``) and ``xeonsd serve`` (``--blend``, a request's
``model``) agree on: OVMS's composite, ``@NAME[:WEIGHT]+@NAME[:WEIGHT]``, each NAME a registered adapter (no weight:
its alpha), none twice, each weight a finite number in -:data:`MAX_WEIGHT`..:data:`MAX_WEIGHT`; and its one normal
form (:func:`blend_key`: the parts sorted by name), which is how the server finds a declared blend's pipelines.
Standard library only: the playbooks check ``serve_blends`` on the controller with it.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from typing import Any

MAX_WEIGHT = 4.0  # the largest |weight| of an adapter in a blend or lora_alphas
COMPOSITE_PART = re.compile(r"^@([A-Za-z0-9][A-Za-z0-9._-]{0,63})(?::(.+))?$")
Chosen = tuple[tuple[str, float], ...]  # adapters with their weights, sorted by name (blend_key); (): the base


class BlendError(ValueError):
    """A blend or weight that cannot be used; ``param`` names the request field or flag it came from."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def checked_weight(value: Any, what: str, param: str) -> float:
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BlendError(f"{what}: the weight must be a number, not {json.dumps(value)}", param)
    if not -MAX_WEIGHT <= value <= MAX_WEIGHT:
        raise BlendError(f"{what}: the weight {value:g} is out of range: -{MAX_WEIGHT:g}..{MAX_WEIGHT:g}", param)
    return float(value)


def blend_key(chosen: dict[str, float]) -> Chosen:
    """The one normal form of an adapter set: the pool's key of its pipelines and a request's lookup of them."""
    return tuple(sorted((name, float(weight)) for name, weight in chosen.items()))


def composite(key: Chosen) -> str:
    """``@a:0.7+@b:0.3``: an adapter set in OVMS's composite syntax."""
    return "+".join(
        f"@{name}:{weight:g}" if float(f"{weight:g}") == weight else f"@{name}:{weight!r}" for name, weight in key
    )


def parse_composite(text: str, alphas: dict[str, float], what: str, param: str = "model") -> dict[str, float]:
    """``@NAME[:WEIGHT]+…`` (OVMS's composite) -> ``{name: weight}`` in the text's order; each NAME a registered
    adapter (no weight: its alpha), none twice; ``what`` starts each error."""
    chosen: dict[str, float] = {}
    for part in text.split("+"):
        m = COMPOSITE_PART.match(part.strip())
        if m is None:
            raise BlendError(f"{what}: {part!r} is not @NAME or @NAME:WEIGHT", param)
        name, weight = m[1], m[2]
        if name not in alphas:
            raise BlendError(f"{what}: no adapter {name!r}; registered: {', '.join(alphas) or 'none'}", param)
        if name in chosen:
            raise BlendError(f"{what}: adapter {name!r} is given twice", param)
        chosen[name] = alphas[name] if weight is None else checked_weight(weight, f"{what}: @{name}", param)
    return chosen


def parse_blend(text: str, alphas: dict[str, float]) -> Chosen:
    """``xeonsd serve --blend`` -> its key: two adapters at least, or one at a weight other than its alpha (a
    "blend of one"); raises :class:`BlendError` naming the flag."""
    what = f"--blend {text!r}"
    chosen = parse_composite(text, alphas, what, "blend")
    if len(chosen) == 1 and all(w == alphas[n] for n, w in chosen.items()):
        raise BlendError(
            f"{what}: one adapter at its own --adapter alpha is that adapter, served without a blend; a blend has "
            "two adapters at least, or one at another weight (@NAME:WEIGHT)",
            "blend",
        )
    return blend_key(chosen)


def parse_blends(texts: tuple[str, ...], alphas: dict[str, float]) -> tuple[Chosen, ...]:
    """Every ``--blend`` (:func:`parse_blend`), none declared twice."""
    keys: list[Chosen] = []
    for text in texts:
        key = parse_blend(text, alphas)
        if key in keys:
            raise BlendError(f"--blend {text!r}: the blend {composite(key)} is declared twice", "blend")
        keys.append(key)
    return tuple(keys)
