"""xeonsd: distributed textual-inversion fine-tuning of Stable Diffusion on Xeon CPUs, exported to OpenVINO."""

__version__ = "0.1.0"
