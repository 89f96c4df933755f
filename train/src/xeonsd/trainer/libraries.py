"""The trainer's libraries, without the packages they import for features that training never uses.

Every rank of a job imports torch, transformers and diffusers before its first step, and on a node that also
carries the OpenVINO side (nncf needs scikit-learn and SciPy) the two libraries pull in far more than training
uses: transformers imports scikit-learn (and through it ``scipy.stats``) for its assisted-generation candidate
generator and ``scipy.optimize`` for the object-detection losses of DETR-like models, and diffusers imports
``scipy.stats`` in its samplers' modules for their beta-sigma schedules. Every rank pays for that.

:func:`skip_unused_packages`, called once by ``xeonsd train`` before its first model import, tells both libraries
that those packages are absent. Nothing the trainer runs uses them (CLIP text encoders, a DDPM noise schedule,
DPM-Solver with the model's own sigmas for validation images), so the models, the numbers and the results are the
same. It changes only the trainer's own process, and nothing where a library already imported them.
"""

from __future__ import annotations

import sys

# transformers' availability checks that training answers "absent": (package, the module that imports it if present)
TRANSFORMERS_SKIPPED = (
    ("sklearn", "transformers.generation.candidate_generator"),
    ("scipy", "transformers.loss.loss_for_object_detection"),
)


def _absent() -> bool:
    return False


def skip_unused_packages() -> list[str]:
    """Tell transformers that scikit-learn and SciPy are absent and diffusers that SciPy is, where the library's
    module that would import them is not imported yet; returns what was skipped (e.g. ``transformers:sklearn``)."""
    skipped = []
    import transformers.utils
    import transformers.utils.import_utils as transformers_imports

    for package, importer in TRANSFORMERS_SKIPPED:
        if importer not in sys.modules:
            name = f"is_{package}_available"
            setattr(transformers_imports, name, _absent)
            setattr(transformers.utils, name, _absent)
            skipped.append(f"transformers:{package}")
    if not any(name.startswith("diffusers.schedulers.") for name in sys.modules):
        import diffusers.utils.import_utils as diffusers_imports

        diffusers_imports._scipy_available = False  # what diffusers.utils.is_scipy_available() returns
        skipped.append("diffusers:scipy")
    return skipped
