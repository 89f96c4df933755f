"""Every model family we serve: one line each in :data:`REGISTRY`, in the order users see them (the README's family
table is this list, ``tests/xeonsd/families/test_registry.py``). A family's folder holds all that is its own
(docs/trainer.md, "Adding a family"); the name is only for what files record (a run's ``train_summary.json``, an
export's manifest), read back here by :func:`by_name`."""

from __future__ import annotations

from typing import Any

from xeonsd.families import (
    flux,
    flux2,
    flux2_dev,
    flux_kontext,
    krea2,
    qwenimage,
    qwenimage_edit,
    sd,
    sd3,
    sdxl,
    zimage,
)
from xeonsd.families.spec import FamilyError, FamilySpec

REGISTRY: tuple[FamilySpec, ...] = (
    sd.SPEC,
    sdxl.SPEC,
    flux.SPEC,
    sd3.SPEC,
    flux2.SPEC,
    zimage.SPEC,
    qwenimage.SPEC,
    flux_kontext.SPEC,
    qwenimage_edit.SPEC,
    krea2.SPEC,
    flux2_dev.SPEC,
)
SPECS: dict[str, FamilySpec] = {found.name: found for found in REGISTRY}


def by_name(name: str) -> FamilySpec:
    """The family a file records as ``name`` (``sd``, ``sdxl``, …); FamilyError naming the known ones."""
    try:
        return SPECS[name]
    except KeyError:
        raise FamilyError(f"unknown model family {name!r}; known: {', '.join(SPECS)}") from None


def of_pipeline_class(cls: str) -> FamilySpec | None:
    """The family whose pipelines include the diffusers class ``cls`` (model_index.json's ``_class_name``), or None:
    what a pipeline directory is, told without reading its components (detection reads them: :mod:`.detect`)."""
    return next((f for f in REGISTRY if cls == f.pipeline_class or cls in f.pipeline_aliases), None)


def of_run(summary: dict[str, Any], run_dir: str) -> FamilySpec:
    """The family a run trained, from its ``train_summary.json`` (a run of an xeonsd older than the ``family``
    field was SD); a FamilyError names the run's summary and the family it does not know."""
    try:
        return by_name(str(summary.get("family") or "sd"))
    except FamilyError as e:
        raise FamilyError(f"{run_dir}/train_summary.json: {e}") from None


def of_manifest(manifest: dict[str, Any]) -> FamilySpec:
    """The family an OpenVINO export was made from (an export written before the manifest's ``family`` field was
    SD 1.x/2.x)."""
    return by_name(str(manifest.get("family") or "sd"))
