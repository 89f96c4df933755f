"""The request of ``xeonsd generate`` (:class:`GenerateOptions`) and its command line, made from its fields
(:mod:`xeonsd.flags`; :mod:`xeonsd.cli` adds the console flags every command shares). Imports nothing but the
standard library: ``xeonsd --help`` stays instant."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from xeonsd.flags import flag

# --precision: what each choice asks of OpenVINO's CPU plugin at compile (both engines). "auto" leaves its default,
# which infers in bf16 on a CPU with AMX or AVX512-BF16 (faster; images differ from PyTorch fp32 by bf16 rounding)
# and in f32 elsewhere.
PRECISIONS: dict[str, dict[str, str]] = {"auto": {}, "f32": {"INFERENCE_PRECISION_HINT": "f32"}}
ENGINES = ("optimum", "genai")  # the OpenVINO engines, on an export
TORCH = "torch"  # the family's diffusers pipeline in PyTorch (xeonsd.torch_engine), on a pipeline directory
# --engine: auto (an export: OpenVINO's genai; a pipeline of a family with no OpenVINO export: torch), openvino
# (genai: OpenVINO's default engine), the two OpenVINO engines by name, torch
ENGINE_CHOICES = ("auto", "openvino", *ENGINES, TORCH)
RECIPE_PROMPT = "a yellow <dicoo> robot at the beach, high quality"


def parse_spec(spec: str) -> tuple[Path, float]:
    """``FILE[:ALPHA]`` (``--lora``, and serve's ``--adapter NAME=FILE[:ALPHA]``) -> (path, alpha); alpha defaults to
    1.0. A path with a colon and no alpha stays whole."""
    head, sep, tail = spec.rpartition(":")
    if sep and head:
        try:
            return Path(head), float(tail)
        except ValueError:
            pass
    return Path(spec), 1.0


def token_flag() -> str | None:
    """``--token``, as ``xeonsd generate`` and ``xeonsd serve`` take it: the name the ``--embeds`` concept is loaded
    under (default: the file's own, its key or, SDXL, its metadata; an A1111 file, or an SDXL file without the
    metadata, needs it)."""
    return flag("load the --embeds concept under this token (default: the token the file names)", default=None)


@dataclass(frozen=True)
class GenerateOptions:
    """What to generate; each field is a flag of ``xeonsd generate``."""

    prompts: tuple[str, ...] = flag(
        "prompt (repeat for several; default: the recipe's)", default=(RECIPE_PROMPT,), name="--prompt", action="append"
    )
    negative_prompt: str | None = flag("what the images should not show", default=None)
    num_images: int = flag("images to make (default 5)", default=5)
    steps: int = flag("denoising steps (default 20)", default=20)
    seed: int = flag("seed of the first call (call k uses seed + k)", default=0)
    guidance_scale: float | None = flag(
        "default: the family's pipeline's (SD/SDXL 7.5, FLUX.1-dev 3.5 as its embedded guidance, SD3 7.0, "
        "FLUX.2 [klein] 4.0, Z-Image 5.0, Qwen-Image 4.0)",
        default=None,
    )
    height: int | None = flag(
        "dynamic exports only (default: the family's, 512 or SDXL 1024); static have their own", default=None
    )
    width: int | None = flag("dynamic exports only (default: the family's resolution)", default=None)
    batch_size: int | None = flag("images per call for a dynamic export (default: all)", default=None)
    engine: str = flag(
        "auto (default): an export runs on OpenVINO (genai), a diffusers pipeline of a family optimum-intel has no "
        "OpenVINO export for (FLUX.1 Kontext, Qwen-Image-Edit) on PyTorch; openvino: genai; genai: "
        "openvino_genai.Text2ImagePipeline; optimum: OVStableDiffusionPipeline; torch: the family's diffusers "
        "pipeline in PyTorch (bf16 on a CPU with AMX or AVX512-BF16, fp32 elsewhere)",
        default="optimum",
        cli_default="auto",
        choices=ENGINE_CHOICES,
    )
    embeds: Path | None = flag("learned_embeds.safetensors to load into the exported text encoder", default=None)
    token: str | None = token_flag()
    loras: tuple[tuple[Path, float], ...] = flag(
        "LoRA adapter applied at load time, no re-export (genai and torch engines; repeat to blend several; ALPHA "
        "default 1.0); for --engine optimum fuse it instead: xeonsd export SRC OUT --lora FILE",
        default=(),
        name="--lora",
        action="append",
        metavar="FILE[:ALPHA]",
        convert=parse_spec,
    )
    references: tuple[Path, ...] = flag(
        "reference image of an edit model (FLUX.1 Kontext: 1, Qwen-Image-Edit: up to 3; repeat for several; torch "
        "engine)",
        default=(),
        name="--image",
        action="append",
        metavar="PATH",
        convert=Path,
    )
    precision: str = flag(
        "auto: OpenVINO's default (bf16 on a CPU with AMX or AVX512-BF16, f32 elsewhere; the torch engine alike); "
        "f32: always f32 (slower there; the images then match PyTorch fp32 closely)",
        default="auto",
        choices=tuple(PRECISIONS),
    )

    def compile_properties(self) -> dict[str, str]:
        """The OpenVINO CPU properties both engines compile with (:data:`PRECISIONS`)."""
        return dict(PRECISIONS[self.precision])


@dataclass(frozen=True)
class GenerateCommand:
    """The command's own arguments around the request: the export (or pipeline) and where the images go."""

    ov_dir: Path = flag(
        "directory written by `xeonsd export`, or for --engine torch a diffusers pipeline directory (the base model, "
        "or a full fine-tune's output)",
        positional=True,
        metavar="SRC",
    )
    out: Path = flag("output directory (default: ./images)", default=Path("images"))
    overwrite: bool = flag("replace a non-empty output directory", default=False)
