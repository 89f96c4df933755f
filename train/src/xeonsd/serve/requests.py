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

LoRA blends (docs/serving.md, "LoRA blends"): ``model`` may also be a composite in OVMS's ``--source_loras``
syntax, ``@a:0.7+@b:0.3`` (each ``@NAME[:WEIGHT]`` a registered adapter; no weight: its ``--adapter`` alpha), and
``lora_alphas`` (OVMS's field: ``{"NAME": WEIGHT}``) overrides the weights of the adapters ``model`` selects, as
OVMS allows it: only those adapters. The syntax and the weights' range: :mod:`xeonsd.contracts.blend_syntax`. A blend
(or an adapter at another weight than its alpha) runs when it is one of the server's ``--blend`` declarations, in
any order of its parts (:func:`blend_key`); any other is refused, naming the declared ones.

Edits (``POST /v3/images/edits``, :mod:`xeonsd.serve.edits`) take the same fields plus ``image``, ``mask`` and
``strength`` (0 < strength <= 1, at least one of the steps run; absent: GenAI's default, 0.8 for
image-to-image, 1 for inpainting); ``size`` there is the image's. On the torch engine an edit family
(``FamilySpec.reference_images``: Qwen-Image-Edit-2511 1 to 3, FLUX.1 Kontext and FLUX.2 [klein] 1) edits by
instruction instead: ``image`` or OpenAI's ``image[]`` (repeated parts) are its reference images, the prompt is the
instruction, and neither ``mask`` nor ``strength`` is taken; a family that needs a reference
(``FamilySpec.reference_required``) makes no images from text alone.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from xeonsd.contracts.blend_syntax import BlendError, Chosen, blend_key, checked_weight, composite, parse_composite
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
        "lora_alphas",
    }
)
EDIT_FIELDS = frozenset({"image", "mask", "strength"})
DEFAULT_STRENGTH = {"image2image": 0.8, "inpainting": 1.0}  # GenAI's defaults for each pipeline


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


async def refuse(
    send: Callable,
    refused: Callable[[str], None],
    message: str,
    status: int,
    code: str,
    kind: str = "invalid_request_error",
    close: bool = True,
    **headers: str,
) -> None:
    """Refuse a request before it reaches a route (:mod:`xeonsd.serve.limits`, :mod:`xeonsd.serve.keys`): counted by
    its ``code`` (``refused``), answered with the error object as the ASGI response (``Connection: close`` unless
    ``close`` is False)."""
    from starlette.responses import JSONResponse

    refused(code)
    if close:
        headers["Connection"] = "close"
    error = RequestError(message, None, status=status, kind=kind, code=code)
    answer = JSONResponse(error.body(), status_code=status, headers=headers)
    await send({"type": "http.response.start", "status": answer.status_code, "headers": answer.raw_headers})
    await send({"type": "http.response.body", "body": answer.body})


@dataclass(frozen=True)
class Limits:
    shape: StaticShape
    models: tuple[str, ...]  # the base model's name first, then the adapters'
    max_images: int
    max_steps: int
    guidance_scale: float  # a request's default: the checkpoint's, else the family's (ServedModel.guidance_scale)
    alphas: tuple[tuple[str, float], ...] = ()  # each registered adapter's --adapter alpha
    family: str = "SD 1.x/2.x"  # the family's label, for the errors
    edits: tuple[str, ...] = ()  # the edits the family's GenAI pipelines run (FamilySpec.genai_edits)
    fused_only: bool = False  # the family takes no GenAI adapters: its LoRA is fused into the export
    blends: tuple[Chosen, ...] = ()  # the --blend keys (blend_key), compiled at start-up
    references: int = 0  # the reference images an edit takes (torch engine, edit family); 0: img2img/inpainting
    reference_required: bool = False  # the family makes no image without a reference (Qwen-Image-Edit-2511)
    engine: str = "OpenVINO GenAI 2026.4.1"  # what runs the requests, for the errors
    default_steps: int = DEFAULT_STEPS  # a request's num_inference_steps when it gives none (ServedModel's)


@dataclass(frozen=True)
class ImageRequest:
    prompt: str
    model: str
    n: int
    steps: int
    seed: int
    guidance_scale: float
    negative_prompt: str | None
    adapters: Chosen = ()  # the adapters applied with their weights (blend_key); (): the base model
    image: Any = None  # an edit's image: uint8 [height, width, 3]
    mask: Any = None  # an inpainting's mask: uint8 [height, width, 3], white where the image is repainted
    strength: float | None = None  # an edit's strength (None: a generation, or an edit by references)
    references: tuple[Any, ...] = ()  # an edit family's reference images: uint8 [h, w, 3] each, any size

    @property
    def kind(self) -> str:
        """``generation``, ``image2image``, ``inpainting`` or ``reference`` (an edit family's instruction edit): the
        pipeline that runs the request."""
        if self.references:
            return "reference"
        if self.image is None:
            return "generation"
        return "image2image" if self.mask is None else "inpainting"

    @property
    def label(self) -> str:
        """The metrics' model label: the model's name, or ``(blend)`` for a composite (its weights are free)."""
        return "(blend)" if self.model.startswith("@") else self.model


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


def validate(body: dict[str, Any], limits: Limits, edit: bool = False) -> ImageRequest:
    """The request ``body`` checked against the served model; the first bad field raises :class:`RequestError`.
    ``edit``: an edit's fields, its ``image`` and ``mask`` already decoded and checked (:mod:`xeonsd.serve.edits`)."""
    known = KNOWN | EDIT_FIELDS if edit else KNOWN
    unknown = sorted(set(body) - known - IGNORED)
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}; this endpoint takes {', '.join(sorted(known))}", unknown[0])
    prompt = _text(body, "prompt")
    if prompt is None or not prompt.strip():
        raise RequestError("prompt is required and must not be empty", "prompt")
    model = body.get("model")
    if model is None:
        model = limits.models[0]
    try:
        adapters = _adapters(model, body.get("lora_alphas"), limits)
    except BlendError as e:  # a bad composite or weight: its error names the field
        raise RequestError(str(e), e.param) from None
    n = _int(body, "n", None, 1, limits.max_images, "--max-images")
    per_prompt = _int(body, "num_images_per_prompt", None, 1, limits.max_images, "--max-images")
    if n is not None and per_prompt is not None and n != per_prompt:
        raise RequestError(f"n {n} and num_images_per_prompt {per_prompt} disagree; give one", "num_images_per_prompt")
    n = n or per_prompt or 1
    default = min(limits.default_steps, limits.max_steps)
    steps = _int(body, "num_inference_steps", default, 1, limits.max_steps, "--max-steps")
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
    guidance = body.get("guidance_scale")
    if guidance is None:  # the served checkpoint's (a distilled one's may be 0: no guidance)
        guidance = limits.guidance_scale
    elif isinstance(guidance, bool) or not isinstance(guidance, int | float) or not math.isfinite(guidance):
        raise RequestError(f"guidance_scale must be a number, not {json.dumps(guidance)}", "guidance_scale")
    elif not 1.0 < guidance <= 50.0:
        raise RequestError(
            f"guidance_scale {guidance} is out of range: above 1 (the export runs classifier-free guidance) up to 50",
            "guidance_scale",
        )
    if not edit and limits.reference_required:
        raise RequestError(
            f"{limits.family} edits reference images and makes no image from text alone: POST /v1/images/edits with "
            f"1 to {limits.references} image[] part(s) and the instruction as the prompt",
            None,
            code="unsupported",
        )
    strength = None if not edit else _edit_checks(body, limits, int(steps))  # type: ignore[arg-type]
    references = tuple(body["image"]) if edit and limits.references else ()
    return ImageRequest(
        prompt=prompt,
        model=str(model),
        n=int(n),  # type: ignore[arg-type]
        steps=int(steps),  # type: ignore[arg-type]
        seed=random.SystemRandom().randrange(2**32) if seed is None else seed,
        guidance_scale=float(guidance),
        negative_prompt=_text(body, "negative_prompt"),
        adapters=adapters,
        image=body.get("image") if edit and not references else None,
        mask=body.get("mask") if edit and not references else None,
        strength=strength,
        references=references,
    )


def _adapters(model: Any, overrides: Any, limits: Limits) -> Chosen:
    """The adapters ``model`` selects with their weights (``lora_alphas`` applied), :func:`blend_key`'s form;
    () for the base model. A blend, or an adapter at another weight, must be declared (``--blend``). A bad
    composite or weight raises the blend syntax's :class:`BlendError`."""
    alphas = dict(limits.alphas)
    if not isinstance(model, str):
        raise RequestError(f"model must be a string, not {json.dumps(model)}", "model")
    if model.startswith("@"):
        if limits.fused_only or not alphas:
            why = (
                f"OpenVINO GenAI applies no adapters to {limits.family}: serve an export with the LoRA fused in"
                if limits.fused_only
                else "this server has no adapters (xeonsd serve --adapter NAME=PATH registers one)"
            )
            raise RequestError(f"model {json.dumps(model)} is a LoRA blend, but {why}", "model")
        chosen = parse_composite(model, alphas, f"model {json.dumps(model)}")
    elif model in limits.models:
        chosen = {model: alphas[model]} if model in alphas else {}
    else:
        raise RequestError(
            f"model {json.dumps(model)} is not served here; known models: {', '.join(limits.models)} "
            "(or a blend of the adapters: @NAME:WEIGHT+@NAME:WEIGHT)",
            "model",
            status=404,
            kind="model_not_found",
        )
    if overrides is not None:
        _override(chosen, overrides, model)
    key = blend_key(chosen)
    if (len(key) > 1 or any(w != alphas[n] for n, w in key)) and key not in limits.blends:
        declared = ", ".join(composite(b) for b in limits.blends) or "none"
        raise RequestError(
            f"model {json.dumps(model)}{'' if overrides is None else ' with lora_alphas'} makes the blend "
            f"{composite(key)}, which this server did not declare (declared: {declared}). OpenVINO GenAI 2026.4.1 "
            "cannot switch adapters on a compiled pipeline, so each blend is compiled at start-up: "
            f"xeonsd serve --blend '{composite(key)}' (docs/serving.md, LoRA blends)",
            "model" if overrides is None else "lora_alphas",
            code="unsupported",
        )
    return key


def _override(chosen: dict[str, float], overrides: Any, model: str) -> None:
    """``lora_alphas`` applied to ``chosen`` (in place): only the adapters ``model`` selects, as OVMS allows."""
    if not isinstance(overrides, dict):
        raise RequestError(
            f'lora_alphas must be an object {{"NAME": WEIGHT}}, not {json.dumps(overrides)}', "lora_alphas"
        )
    for name, weight in overrides.items():
        if name not in chosen:
            active = ", ".join(chosen) or "none (the base model)"
            raise RequestError(
                f"lora_alphas: {name!r} is not an adapter that model {json.dumps(model)} selects ({active}); "
                "blend several with model @NAME:WEIGHT+@NAME:WEIGHT",
                "lora_alphas",
            )
        chosen[name] = checked_weight(weight, f"lora_alphas {name!r}", "lora_alphas")


def _edit_checks(body: dict[str, Any], limits: Limits, steps: int) -> float | None:
    """An edit's family support and ``strength`` (None: an edit by reference images, :func:`_reference_checks`)."""
    kind, param = ("inpainting", "mask") if body.get("mask") is not None else ("image2image", "image")
    if body.get("image") is None:
        what = f"1 to {limits.references} reference image(s) (image[])" if limits.references else "the PNG or JPEG"
        raise RequestError(f"image is required: {what} to edit", "image")
    if limits.references:
        _reference_checks(body, limits)
        return None
    if kind not in limits.edits:
        runs = f"only {' and '.join(limits.edits)}" if limits.edits else "no edits: it takes a prompt only"
        raise RequestError(
            f"{limits.family} has no {kind} in {limits.engine} (it runs {runs})", param, code="unsupported"
        )
    strength = body.get("strength", DEFAULT_STRENGTH[kind])
    if isinstance(strength, bool) or not isinstance(strength, int | float) or not math.isfinite(strength):
        raise RequestError(f"strength must be a number, not {json.dumps(strength)}", "strength")
    if not 0.0 < strength <= 1.0:
        raise RequestError(f"strength {strength:g} is out of range: above 0, at most 1", "strength")
    if int(steps * strength) < 1:  # GenAI and diffusers run int(steps * strength) of the steps
        raise RequestError(
            f"strength {strength:g} of num_inference_steps {steps} runs no step (an edit runs int(steps x strength)); "
            "give more steps or a higher strength",
            "strength",
        )
    return float(strength)


def _reference_checks(body: dict[str, Any], limits: Limits) -> None:
    """An edit family's request: 1 to ``limits.references`` reference images, no mask, no strength."""
    takes = f"{limits.family} edits by instruction from 1 to {limits.references} reference image(s) (image[])"
    if body.get("mask") is not None:
        raise RequestError(f"{takes} and takes no mask; drop the mask", "mask", code="unsupported")
    if body.get("strength") is not None:
        raise RequestError(f"{takes} and takes no strength; drop it", "strength", code="unsupported")
    given = len(body["image"])
    if given > limits.references:
        raise RequestError(f"{takes}; this request gives {given}", "image[]")
