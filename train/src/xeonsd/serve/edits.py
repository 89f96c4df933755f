"""``POST /v3/images/edits`` and ``/v1/images/edits``: the multipart body as OpenAI's ``images.edit`` and OVMS send
it, turned into the fields :func:`xeonsd.serve.requests.validate` checks.

* ``image`` (required) and ``mask`` (optional) are files, PNG or JPEG. Each is refused with a 400 naming its field
  when it is not an image, another format, larger than :data:`MAX_PIXELS` (a decompression bomb: the check reads
  the header only, before any pixel is decoded), truncated, or of a mode that cannot be converted to RGB. The
  image must have the export's static size (the server does not resize: a resized image is another image, so the
  client chooses how); the mask must have the image's size.
* The mask marks what is repainted. Two conventions are read: OVMS's and GenAI's, white (repaint) on black
  (keep), and OpenAI's, a PNG whose fully transparent pixels are repainted. A mask with any transparent pixel is
  read as OpenAI's (alpha 0: repaint), any other as OVMS's (gray level, so white is repaint).
* An edit family on the torch engine (``Limits.references``) takes its reference images as ``image`` or OpenAI's
  multi-image field ``image[]`` (repeated parts, in order), each checked as ``image`` is (not an image, too large,
  truncated, a mode that cannot be RGB: a 400 naming its field) and of any size: the family's pipeline sizes them
  itself. Any other family takes one ``image``; more is refused, naming the family.
* The other fields are text: ``n``, ``num_inference_steps``, ``rng_seed`` become integers, ``strength`` and
  ``guidance_scale`` numbers, ``lora_alphas`` a JSON object; a field that does not parse is refused by name.
  Fields given twice (but ``image[]``), and any file but ``image``, ``image[]`` and ``mask``, are refused.
"""

from __future__ import annotations

import io
import json
from typing import Any

from xeonsd.openvino.manifest import StaticShape
from xeonsd.serve.requests import Limits, RequestError

MAX_PIXELS = 4096 * 4096  # OVMS's default max_resolution; Pillow's own bomb limit is 89 M pixels
FORMATS = ("PNG", "JPEG")
INTEGERS = ("n", "num_images_per_prompt", "num_inference_steps", "rng_seed", "height", "width")
NUMBERS = ("strength", "guidance_scale")
IMAGES = ("image", "image[]")  # image[]: OpenAI's multi-image edits field, one part per image
FILES = (*IMAGES, "mask")
MAX_FILES = 8  # a mask and more reference images than any family takes, so that the count is refused by name
MAX_FIELDS = 32


def read_image(data: bytes, param: str) -> Any:
    """The PNG or JPEG ``data`` as a Pillow image, loaded; a :class:`RequestError` naming ``param`` otherwise."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise RequestError(f"{param} is not a PNG or JPEG image ({len(data)} bytes)", param) from None
    except Image.DecompressionBombError as exc:  # above twice Pillow's own limit: a bomb by its header
        raise RequestError(f"{param} is refused as a decompression bomb: {exc}", param) from None
    width, height = img.size
    if width * height > MAX_PIXELS:
        raise RequestError(
            f"{param} is {width}x{height} pixels, more than the {MAX_PIXELS} this server decodes "
            "(a decompression bomb, or far larger than the export's size)",
            param,
        )
    try:
        img.load()
    except (OSError, SyntaxError, ValueError) as exc:
        raise RequestError(f"{param} is a damaged or truncated {img.format} image: {exc}", param) from None
    return img


def _rgb(img: Any, param: str) -> Any:
    import numpy as np

    try:
        return np.ascontiguousarray(np.asarray(img.convert("RGB"), dtype=np.uint8))
    except (OSError, ValueError) as exc:
        raise RequestError(f"{param} has the mode {img.mode}, which cannot be converted to RGB: {exc}", param) from None


def image_array(data: bytes, shape: StaticShape) -> Any:
    """The edit's ``image`` as uint8 [height, width, 3], of the export's static size."""
    img = read_image(data, "image")
    if img.size != (shape.width, shape.height):
        raise RequestError(
            f"image is {img.size[0]}x{img.size[1]}; this export makes {shape.width}x{shape.height} images and the "
            f"server does not resize: send a {shape.width}x{shape.height} image",
            "image",
        )
    return _rgb(img, "image")


def mask_array(data: bytes, size: tuple[int, int]) -> Any:
    """The edit's ``mask`` as uint8 [height, width, 3], 255 where the image is repainted; ``size`` is (w, h)."""
    import numpy as np

    img = read_image(data, "mask")
    if img.size != size:
        raise RequestError(
            f"mask is {img.size[0]}x{img.size[1]}, the image {size[0]}x{size[1]}: they must have one size", "mask"
        )
    alpha = None
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        alpha = np.asarray(img.convert("RGBA"), dtype=np.uint8)[..., 3]
    if alpha is not None and (alpha == 0).any():
        gray = np.where(alpha == 0, 255, 0).astype(np.uint8)  # OpenAI: transparent is repainted
    else:
        gray = _rgb(img, "mask").mean(axis=2).round().astype(np.uint8)
    return np.ascontiguousarray(np.repeat(gray[..., None], 3, axis=2))


def _scalar(key: str, text: str) -> Any:
    if key in INTEGERS:
        try:
            return int(text)
        except ValueError:
            raise RequestError(f"{key} must be an integer, not {text!r}", key) from None
    if key in NUMBERS:
        try:
            return float(text)
        except ValueError:
            raise RequestError(f"{key} must be a number, not {text!r}", key) from None
    if key == "lora_alphas":
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise RequestError(f'lora_alphas must be a JSON object {{"NAME": WEIGHT}}, not {text!r}', key) from None
    return text


async def parse_form(request: Any, limits: Limits) -> dict[str, Any]:
    """The multipart body of ``request`` as the fields :func:`validate` takes (``image``/``mask`` as arrays; an edit
    family's references as a list of arrays in ``image``)."""
    kind = request.headers.get("content-type", "")
    if not kind.startswith("multipart/form-data"):
        raise RequestError(
            f"an edit is a multipart/form-data body (image, mask, prompt, ...), not {kind or 'no content type'}",
            None,
        )
    try:
        form = await request.form(max_files=MAX_FILES, max_fields=MAX_FIELDS)
    except Exception as exc:  # starlette's MultiPartException, a malformed body  # noqa: BLE001
        raise RequestError(f"the multipart body cannot be read: {exc}", None) from None
    try:
        body, files, images = await _read_form(form)
    finally:
        await form.close()
    shape = limits.shape
    if limits.references:
        if images:
            body["image"] = [_rgb(read_image(data, key), key) for key, data in images]
        if "mask" in files:
            body["mask"] = files["mask"]  # refused by validate, naming what the family takes
        return body
    if len(images) > 1:
        raise RequestError(
            f"{limits.family} takes one image to edit (image2image, or inpainting with a mask), not {len(images)}: "
            "it takes no reference images",
            images[1][0],
        )
    if images:
        body["image"] = image_array(images[0][1], shape)
    if "mask" in files:
        body["mask"] = mask_array(files["mask"], (shape.width, shape.height))
    return body


async def _read_form(form: Any) -> tuple[dict[str, Any], dict[str, bytes], list[tuple[str, bytes]]]:
    """The text fields (parsed), the mask, and the image parts in order as (field, bytes)."""
    from starlette.datastructures import UploadFile

    body: dict[str, Any] = {}
    files: dict[str, bytes] = {}
    images: list[tuple[str, bytes]] = []
    for key, value in form.multi_items():
        if key in IMAGES and isinstance(value, UploadFile):
            images.append((key, await value.read()))
            continue
        if key in body or key in files:
            raise RequestError(f"{key} is given twice; give it once", key)
        if isinstance(value, UploadFile):
            if key not in FILES:
                raise RequestError(f"{key} is a file; only image, image[] and mask may be", key)
            files[key] = await value.read()
        elif key in FILES:
            raise RequestError(f"{key} must be a file (multipart filename=...), not a text field", key)
        else:
            body[key] = _scalar(key, value)
    return body, files, images
