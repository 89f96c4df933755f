"""The OpenVINO tests' session exports and concept (tests/xeonsd/openvino/ov_assets.py), defined once for every
test under tests/xeonsd: the OpenVINO, serve and bench tests that use ``ov_base`` or ``embeds`` share one export
per session (each a fixture of its own in each conftest, they were made once per directory: ~15 s an export)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "openvino"))  # ov_assets: the shared exports

from ov_assets import (  # noqa: E402, F401
    embeds,
    flux_lora,
    full_pipeline,
    ov_baked,
    ov_base,
    ov_flux,
    ov_flux_lora,
    ov_full_dynamic,
    ov_sd3_lora,
    sd3_lora,
)
