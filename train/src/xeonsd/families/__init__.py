"""The model families, one folder each (``sd/``, ``sdxl/``, ``flux/``, ``sd3/``, ``flux2/``, ``zimage/``,
``qwenimage/``, ``flux_kontext/``, ``qwenimage_edit/``, ``krea2/``, ``flux2_dev/``), registered once in
:mod:`.registry`:

* a folder's ``__init__`` is its :class:`FamilySpec` (``SPEC``): files, classes, text side, objective, LoRA and
  concept layouts, what OpenVINO GenAI applies, the pipeline's defaults, the pipelines it trains as and the edit
  variants refused; its ``training`` module is how it trains (the :class:`xeonsd.families.training.TrainFamily`
  hooks: conditioning, latents, objective, LoRA targets);
* :mod:`.detect`: which family a pipeline is, from its config files before any weight loads (:class:`Family`: the
  spec with the sizes read); :mod:`.spec`, :mod:`.training` and :mod:`.flow`: what every family, and every
  rectified-flow family, shares.

Every command gets a :class:`Family` (from detection) or a :class:`FamilySpec` (from a run's or an export's files,
:func:`by_name`) and hands that object on; nothing else looks a family up by its name.

The specs, the registry and detection are the standard library's (the playbooks' filter plugins import them without
torch); a family's ``training`` module may import :mod:`xeonsd.trainer`, :mod:`xeonsd.cluster` and
:mod:`xeonsd.modelfiles`, and is imported only through :attr:`FamilySpec.training`.
"""

from __future__ import annotations

from xeonsd.families.detect import Family, detect_family, family_of, family_spec, vae_scale
from xeonsd.families.registry import REGISTRY, SPECS, by_name, of_manifest, of_pipeline_class, of_run
from xeonsd.families.spec import FamilyError, FamilySpec, tokenizer_limit

__all__ = [
    "REGISTRY",
    "SPECS",
    "Family",
    "FamilyError",
    "FamilySpec",
    "by_name",
    "detect_family",
    "family_of",
    "family_spec",
    "of_manifest",
    "of_pipeline_class",
    "of_run",
    "tokenizer_limit",
    "vae_scale",
]
