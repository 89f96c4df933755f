"""The OpenVINO tests' session exports (made once, shared by every module here): see ov_assets."""

from ov_assets import embeds, full_pipeline, ov_baked, ov_base, ov_full_dynamic  # noqa: F401
