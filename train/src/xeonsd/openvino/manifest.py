"""The OpenVINO export directory: what ``xeonsd export`` writes beside the IR files, and how a reader checks it.

An export directory is what ``OVStableDiffusionPipeline.save_pretrained`` writes (loadable with
``OVStableDiffusionPipeline.from_pretrained(OUT)``), plus ``tokenizer/openvino_tokenizer.xml`` for
``openvino_genai.Text2ImagePipeline`` and ``xeonsd_export.json``, the manifest: source, shapes, concept
token(s), weight format, versions and a fingerprint of every component, so that a directory assembled from two
exports (or edited afterwards) is refused instead of producing silently wrong images.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

MANIFEST = "xeonsd_export.json"
FORMAT = "xeonsd-openvino-export/1"
# the denoiser (a UNet, or FLUX's/SD3's transformer), the VAE and up to three text encoders (SD3's third: T5)
COMPONENTS = ("unet", "transformer", "vae_decoder", "vae_encoder", "text_encoder", "text_encoder_2", "text_encoder_3")
REQUIRED = ("vae_decoder", "text_encoder")  # and the family's denoiser
OV_TOKENIZER = Path("tokenizer") / "openvino_tokenizer.xml"
VERSIONED = (
    "torch",
    "diffusers",
    "transformers",
    "optimum",
    "optimum-intel",
    "openvino",
    "openvino-tokenizers",
    "openvino-genai",
    "nncf",
)


class ExportDirError(ValueError):
    """The directory is not a (complete, consistent) xeonsd OpenVINO export."""


@dataclass(frozen=True)
class StaticShape:
    """The shape an export was reshaped to: ``batch_size`` prompts x ``num_images_per_prompt`` images."""

    batch_size: int
    height: int
    width: int
    num_images_per_prompt: int

    @property
    def images_per_call(self) -> int:
        return self.batch_size * self.num_images_per_prompt

    def describe(self) -> str:
        return (
            f"static batch {self.batch_size} prompt(s) x {self.num_images_per_prompt} image(s) per prompt "
            f"at {self.width}x{self.height}"
        )


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(ov_dir: Path) -> dict[str, dict[str, Any]]:
    """Hash of each component's graph (``.xml``) and size of its weights (``.bin``); hashing the graphs is cheap."""
    files = {name: ov_dir / name / "openvino_model.xml" for name in COMPONENTS}
    # tokenizer_2: SDXL's, FLUX's (T5) and SD3's second tokenizer; tokenizer_3: SD3's T5
    files |= {f"openvino_tokenizer{n}": ov_dir / f"tokenizer{n}" / OV_TOKENIZER.name for n in ("", "_2", "_3")}
    return {
        key: {"xml_sha256": _sha256(xml), "bin_bytes": xml.with_suffix(".bin").stat().st_size}
        for key, xml in files.items()
        if xml.is_file()
    }


def write_manifest(ov_dir: Path, manifest: dict[str, Any]) -> Path:
    data = {"format": FORMAT, **manifest, "components": fingerprint(ov_dir), "versions": versions()}
    path = ov_dir / MANIFEST
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def read_manifest(ov_dir: Path, verify: bool = True) -> dict[str, Any]:
    """Load and check the manifest of an export; raise :class:`ExportDirError` naming what is wrong."""
    ov_dir = Path(ov_dir)
    if not ov_dir.is_dir():
        raise ExportDirError(f"{ov_dir} does not exist or is not a directory")
    path = ov_dir / MANIFEST
    if not path.is_file():
        torch_pipeline = (ov_dir / "model_index.json").is_file()
        hint = " (it is a diffusers PyTorch pipeline: run `xeonsd export` first)" if torch_pipeline else ""
        raise ExportDirError(f"{ov_dir} is not an xeonsd OpenVINO export: {MANIFEST} is missing{hint}")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ExportDirError(f"{path} is not valid JSON: {exc}") from exc
    if manifest.get("format") != FORMAT:
        raise ExportDirError(f"{path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    from xeonsd.families import FamilyError, of_manifest

    try:
        denoiser = of_manifest(manifest).denoiser
    except FamilyError as exc:
        raise ExportDirError(f"{path}: {exc}") from exc
    for name in (denoiser, *REQUIRED):
        if not (ov_dir / name / "openvino_model.xml").is_file() or not (ov_dir / name / "openvino_model.bin").is_file():
            raise ExportDirError(f"{ov_dir} is incomplete: {name}/openvino_model.xml/.bin is missing")
    if verify:
        found = fingerprint(ov_dir)
        for name, want in manifest.get("components", {}).items():
            if found.get(name) != want:
                raise ExportDirError(
                    f"{ov_dir}: {name} does not match {MANIFEST} (it comes from a different export or was modified "
                    "after export); re-export the model"
                )
    return manifest


def static_shape(manifest: dict[str, Any]) -> StaticShape | None:
    shape = manifest.get("static_shape")
    return None if shape is None else StaticShape(**shape)


def check_writable_output(out: Path, overwrite: bool = False) -> None:
    """Fail before any work when ``out`` cannot be created: not a directory, not empty (unless ``overwrite``), or
    no write access (even for root)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportDirError(f"output {out} exists and is not a directory")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ExportDirError(f"cannot create output {out}: {parent} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".xeonsd-write-probe-", dir=parent)
    except OSError as exc:
        raise ExportDirError(f"cannot write output {out}: {parent} is not writable ({exc.strerror})") from exc
    os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(probe)
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportDirError(f"output {out} already exists and is not empty; remove it or pass --overwrite")
