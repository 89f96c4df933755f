"""The flags of ``xeonsd generate`` (its parser lives here, beside the command; :mod:`xeonsd.cli` adds the console
flags every command shares). Imports nothing but the standard library: ``xeonsd --help`` stays instant."""

from __future__ import annotations

import argparse

# --precision: what each choice asks of OpenVINO's CPU plugin at compile (both engines). "auto" leaves its default,
# which infers in bf16 on a CPU with AMX or AVX512-BF16 (faster; images differ from PyTorch fp32 by bf16 rounding)
# and in f32 elsewhere.
PRECISIONS: dict[str, dict[str, str]] = {"auto": {}, "f32": {"INFERENCE_PRECISION_HINT": "f32"}}


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ov_dir", help="directory written by `xeonsd export`")
    p.add_argument("--prompt", action="append", help="prompt (repeat for several; default: the recipe's)")
    p.add_argument("--negative-prompt")
    p.add_argument("--num-images", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0, help="seed of the first call (call k uses seed + k)")
    p.add_argument(
        "--guidance-scale",
        type=float,
        help="default: the family's pipeline's (SD/SDXL 7.5, FLUX.1-dev 3.5 as its embedded guidance, SD3 7.0, "
        "FLUX.2 [klein] 4.0, Z-Image 5.0, Qwen-Image 4.0)",
    )
    p.add_argument(
        "--height",
        type=int,
        help="dynamic exports only (default: the family's, 512 or SDXL 1024); static have their own",
    )
    p.add_argument("--width", type=int, help="dynamic exports only (default: the family's resolution)")
    p.add_argument("--batch-size", type=int, help="images per call for a dynamic export (default: all)")
    p.add_argument(
        "--engine",
        choices=["optimum", "genai"],
        default="genai",
        help="genai: openvino_genai.Text2ImagePipeline; optimum: OVStableDiffusionPipeline",
    )
    p.add_argument("--embeds", help="learned_embeds.safetensors to load into the exported text encoder")
    p.add_argument("--token", help="load the --embeds concept under this token")
    p.add_argument(
        "--lora",
        action="append",
        metavar="FILE[:ALPHA]",
        help="LoRA adapter applied at load time, no re-export (genai engine; repeat to blend several; "
        "ALPHA default 1.0); for --engine optimum fuse it instead: xeonsd export SRC OUT --lora FILE",
    )
    p.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        default="auto",
        help="auto: OpenVINO's default (bf16 on a CPU with AMX or AVX512-BF16, f32 elsewhere); f32: always f32 "
        "(slower there; the images then match PyTorch fp32 closely)",
    )
    p.add_argument("--out", default="images", help="output directory (default: ./images)")
    p.add_argument("--overwrite", action="store_true")
