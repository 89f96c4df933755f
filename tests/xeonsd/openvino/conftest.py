"""The OpenVINO tests' session exports (made once, shared by every module here and by the serve and bench tests):
see ov_assets; they are defined in tests/xeonsd/conftest.py."""
