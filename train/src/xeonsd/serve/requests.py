"""One images request, validated: the OpenAI images API's fields and OVMS's additions, each refused by name.

Accepted (``POST /v3/images/generations``, ``/v1/images/generations``): ``prompt`` (required, not empty),
``model`` (the base model's name or a registered adapter; absent: the base), ``n`` (1..``--max-images``),
``size`` (``WxH``, only the export's static shape; ``auto`` or absent: that shape), ``response_format``
(``b64_json``, the only one: no image is stored to link to), and from OVMS ``num_inference_steps``
(1..``--max-steps``, default 20), ``rng_seed`` (0..2**32-1, GenAI's seed range; absent: a random seed, logged
in the access line: give one to reproduce an image), ``guidance_scale`` (> 1; default: the family's
pipeline's, 7.5 for SD, 3.5 for FLUX.1), ``negative_prompt``, ``num_images_per_prompt`` (OVMS's name for ``n``), ``height`` and ``width`` (the static
shape's, like ``size``). The OpenAI ``user`` is accepted and ignored; any other field is refused, naming it, as OVMS
refuses the OpenAI fields that choose among a hosted model's options (``quality``, ``style``, ``background``, …).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any

from xeonsd.openvino.manifest import StaticShape

DEFAULT_STEPS = 20
MAX_PROMPT = 4000  # characters; CLIP reads 77 tokens of it anyway
IGNORED = frozenset({"user"})
KNOWN = frozenset(
    {
        "prompt",
        "model",
        "n",
        "size",
        "response_format",
        "num_images_per_prompt",
        "height",
        "width",
        "num_inference_steps",
        "rng_seed",
        "guidance_scale",
        "negative_prompt",
    }
)


class RequestError(ValueError):
    """A bad request: ``param`` names the field (None: the body itself), ``status`` is the HTTP status."""

    def __init__(
        self,
        message: str,
        param: str | None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.param = param
        self.status = status
        self.kind = kind
        self.code = code

    def body(self) -> dict[str, Any]:
        """The OpenAI error object."""
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    shape: StaticShape
    models: tuple[str, ...]  # the base model's name first, then the adapters'
    max_images: int
    max_steps: int
    guidance_scale: float  # a request's default: the family's pipeline's (FamilySpec.guidance_scale)


@dataclass(frozen=True)
class ImageRequest:
    prompt: str
    model: str
    n: int
    steps: int
    seed: int
    guidance_scale: float
    negative_prompt: str | None


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a :class:`RequestError`."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"the body is not valid JSON: {exc}", None) from None
    except RecursionError:  # found by tests/xeonsd/serve/test_serve_fuzz.py: a 500 before
        raise RequestError("the body's JSON nests deeper than this server parses", None) from None
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, not {type(body).__name__}", None)
    return body


def _int(body: dict[str, Any], key: str, default: int | None, low: int, high: int, why: str) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{key} must be an integer, not {json.dumps(value)}", key)
    if not low <= value <= high:
        raise RequestError(f"{key} {value} is out of range: {low}..{high} ({why})", key)
    return value


def _text(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise RequestError(f"{key} must be a string, not {json.dumps(value)}", key)
    if len(value) > MAX_PROMPT:
        raise RequestError(f"{key} is {len(value)} characters long; at most {MAX_PROMPT}", key)
    return value


def validate(body: dict[str, Any], limits: Limits) -> ImageRequest:
    """The request ``body`` checked against the served model; the first bad field raises :class:`RequestError`."""
    unknown = sorted(set(body) - KNOWN - IGNORED)
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}; this endpoint takes {', '.join(sorted(KNOWN))}", unknown[0])
    prompt = _text(body, "prompt")
    if prompt is None or not prompt.strip():
        raise RequestError("prompt is required and must not be empty", "prompt")
    model = body.get("model")
    if model is None:
        model = limits.models[0]
    if model not in limits.models:
        raise RequestError(
            f"model {json.dumps(model)} is not served here; known models: {', '.join(limits.models)}",
            "model",
            status=404,
            kind="model_not_found",
        )
    n = _int(body, "n", None, 1, limits.max_images, "--max-images")
    per_prompt = _int(body, "num_images_per_prompt", None, 1, limits.max_images, "--max-images")
    if n is not None and per_prompt is not None and n != per_prompt:
        raise RequestError(f"n {n} and num_images_per_prompt {per_prompt} disagree; give one", "num_images_per_prompt")
    n = n or per_prompt or 1
    steps = _int(body, "num_inference_steps", min(DEFAULT_STEPS, limits.max_steps), 1, limits.max_steps, "--max-steps")
    seed = _int(body, "rng_seed", None, 0, 2**32 - 1, "an unsigned 32-bit integer, GenAI's seed")
    shape = limits.shape
    size = body.get("size")
    if size not in (None, "auto", f"{shape.width}x{shape.height}"):
        raise RequestError(
            f"size {json.dumps(size)} does not fit this export: it has a {shape.describe()}; "
            f"ask for {shape.width}x{shape.height} (or re-export with that size)",
            "size",
        )
    for key, have in (("width", shape.width), ("height", shape.height)):
        if body.get(key) not in (None, have):
            raise RequestError(
                f"{key} {json.dumps(body[key])} does not fit this export: it has a {shape.describe()}", key
            )
    if body.get("response_format") not in (None, "b64_json"):
        raise RequestError(
            f"response_format {json.dumps(body['response_format'])} is not served: only b64_json", "response_format"
        )
    if body.get("output_format") not in (None, "png"):
        raise RequestError(
            f"output_format {json.dumps(body['output_format'])} is not served: only png", "output_format"
        )
    guidance = body.get("guidance_scale", limits.guidance_scale)
    if isinstance(guidance, bool) or not isinstance(guidance, int | float) or not math.isfinite(guidance):
        raise RequestError(f"guidance_scale must be a number, not {json.dumps(guidance)}", "guidance_scale")
    if not 1.0 < guidance <= 50.0:
        raise RequestError(
            f"guidance_scale {guidance} is out of range: above 1 (the export runs classifier-free guidance) up to 50",
            "guidance_scale",
        )
    return ImageRequest(
        prompt=prompt,
        model=str(model),
        n=int(n),  # type: ignore[arg-type]
        steps=int(steps),  # type: ignore[arg-type]
        seed=random.SystemRandom().randrange(2**32) if seed is None else seed,
        guidance_scale=float(guidance),
        negative_prompt=_text(body, "negative_prompt"),
    )
