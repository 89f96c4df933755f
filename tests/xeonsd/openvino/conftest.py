"""The OpenVINO tests' session exports (made once, shared by every module here): see ov_assets."""

from ov_assets import (  # noqa: F401
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
