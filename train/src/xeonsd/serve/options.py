"""What ``xeonsd serve`` serves, checked before anything is compiled: the options and the export (its concept,
``--embeds``, in :mod:`xeonsd.serve.concept`, its adapters, ``--adapter``, in :mod:`xeonsd.serve.adapters`; the
three put together by :func:`xeonsd.serve.prepare.prepare`).

``--workers auto`` is :func:`auto_workers`: one worker per :data:`CORES_PER_WORKER` core(s), the count that gave
the most images/s in ``xeonsd bench serve`` here (docs/benchmarks.md, "Serving"), and no more workers than the
memory holds: each worker compiles the pipelines of the base, of every adapter and of every ``--blend``
(:func:`compiled_copies`), each copy estimated at :data:`PIPELINE_MEMORY` times the weights it compiles, within
:data:`MEMORY_SHARE` of the memory available.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xeonsd.contracts.serve_plan import ADAPTER_NAME as NAME  # a model's name: the base's or an adapter's
from xeonsd.flags import flag
from xeonsd.openvino.generate_args import PRECISIONS, parse_spec, token_flag

if TYPE_CHECKING:
    from xeonsd.families import FamilySpec
    from xeonsd.openvino.manifest import StaticShape

# Measured (docs/benchmarks.md, "Serving"): throughput is best with one worker per this many cores.
CORES_PER_WORKER = 1
PIPELINE_MEMORY = 1.5  # a compiled pipeline's memory over its weights' size (an estimate, not a measurement)
MEMORY_SHARE = 0.8  # of MemAvailable, for the workers together
COMPILED = ("unet", "text_encoder", "text_encoder_2", "vae_decoder")  # what a worker compiles
# Two 1024 px PNGs (an image and a mask) in one multipart edit: at most 4 MiB each (RGBA, incompressible), with
# room for the form's other fields and a noisy image's PNG overhead: twice that.
MAX_BODY_BYTES = 16 * 1024 * 1024
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
SERVE_ENGINES = ("auto", "genai", "torch")  # --engine: xeonsd.serve.genai_pool, xeonsd.serve.torch_pool


class ServeError(ValueError):
    """``xeonsd serve`` cannot serve this export or these options."""


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: Path
    alpha: float = 1.0


def parse_adapter(spec: str) -> AdapterSpec:
    """``NAME=PATH[:ALPHA]`` -> :class:`AdapterSpec`."""
    name, sep, rest = spec.partition("=")
    if not sep or not rest:
        raise ServeError(f"--adapter {spec!r}: expected NAME=PATH[:ALPHA]")
    if not NAME.match(name):
        raise ServeError(f"--adapter {spec!r}: NAME must be letters, digits, '.', '_' or '-' (at most 64)")
    path, alpha = parse_spec(rest)
    return AdapterSpec(name=name, path=path, alpha=alpha)


def parse_allow_from(text: str) -> tuple[Network, ...]:
    """``CIDR[,CIDR...]`` (an address alone is its /32 or /128) -> the networks, or a :class:`ServeError`."""
    networks = []
    for part in (p.strip() for p in text.split(",")):
        try:
            networks.append(ipaddress.ip_network(part))
        except ValueError as e:
            raise ServeError(
                f"--allow-from {part!r}: not a network ({e}); give CIDR[,CIDR...], e.g. 10.0.0.0/24"
            ) from None
    return tuple(networks)


def parse_workers(text: str) -> int | str:
    """``--workers``: ``auto``, or a count (checked against the cores by :func:`resolve_workers`)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ServeError(f"--workers must be a positive count or auto, not {text!r}") from None


@dataclass(frozen=True)
class ServeOptions:
    """What ``xeonsd serve`` serves and how; each field is its flag (:mod:`xeonsd.flags`, dashed names)."""

    export_dir: Path = flag(
        "directory written by `xeonsd export`, or for --engine torch a diffusers pipeline directory (the base model, "
        "or a full fine-tune's output)",
        positional=True,
    )
    engine: str = flag(
        "auto: an export on genai, a pipeline directory of a family OpenVINO cannot export (FLUX.1 Kontext, "
        "Qwen-Image-Edit, Krea 2) on torch; genai: OpenVINO GenAI over an export; torch: the family's diffusers "
        "pipeline, any family (docs/serving.md, Engines)",
        default="auto",
        choices=SERVE_ENGINES,
    )
    size: str | None = flag(
        "--engine torch: the images' WxH (default: the model's own resolution); an export's size is its static shape",
        default=None,
        metavar="WxH",
    )
    adapters: tuple[AdapterSpec, ...] = flag(
        "register a LoRA file under NAME (a request's model picks it; repeat for several; ALPHA default 1.0)",
        default=(),
        name="--adapter",
        action="append",
        metavar="NAME=PATH[:ALPHA]",
        convert=parse_adapter,
    )
    blends: tuple[str, ...] = flag(
        "compile a LoRA blend of registered adapters at start-up, in OVMS's composite syntax (@A:0.7+@B:0.3); a "
        "request whose model (with lora_alphas) makes it, parts in any order, runs on it. Two adapters at least, or "
        "one at another weight than its --adapter alpha (@A:0.5); repeat for several. Each costs a compile and a "
        "copy of the models per worker (docs/serving.md, LoRA blends)",
        default=(),
        name="--blend",
        action="append",
        metavar="@A:W+@B:W",
    )
    embeds: Path | None = flag(
        "a learned concept (textual inversion: learned_embeds.safetensors, as xeonsd generate --embeds takes it) "
        "added at start-up to an overlay of the export's text encoder(s) and tokenizer(s), which every worker "
        "compiles from: the base and every adapter know its token (docs/serving.md, Textual inversion)",
        default=None,
        metavar="FILE",
    )
    token: str | None = token_flag()
    host: str = flag("address to listen on (default 127.0.0.1)", default="127.0.0.1")
    api_key_file: Path | None = flag(
        "one key per line, KEY or NAME:KEY: every route but /v2/health/* then needs Authorization: Bearer KEY "
        "(else 401); SIGHUP reloads the file (default: no key; a warning when --host is beyond loopback)",
        default=None,
        metavar="FILE",
    )
    # xeonsd.serve.limits: who may connect and how large, slow and frequent a request may be
    allow_from: tuple[Network, ...] = flag(
        "answer only clients in these networks (the front's address); others get 403 before any other work. "
        "Loopback is always allowed, so the node's own checks work (default: any address)",
        default=(),
        cli_default=None,
        type=str,
        metavar="CIDR[,CIDR...]",
        convert=parse_allow_from,
    )
    max_body_bytes: int = flag(
        "the largest request body, by Content-Length or as it streams in; past it: 413 "
        f"(default {MAX_BODY_BYTES}: two 1024 px PNGs of an image edit, with room to spare)",
        default=MAX_BODY_BYTES,
        metavar="N",
    )
    read_timeout: float = flag(
        "the headers must arrive within this of the connection, the body within this of the headers; "
        "else 408 and the connection is closed (default 30)",
        default=30.0,
        metavar="SECONDS",
    )
    rate_limit: int = flag(
        "requests per minute per API key (per client address without --api-key-file), a burst of N; past it: "
        "429 with Retry-After; the health checks and /metrics are not counted (default 0: no limit)",
        default=0,
        metavar="N",
    )
    port: int = flag("port (default 8000; 0: any free port)", default=8000)
    workers: int | str = flag(
        "pipelines generating at once, each on its share of the cores (auto: one per core, as many as "
        "the memory holds; --engine torch: one, on every core; docs/serving.md)",
        default="auto",
        metavar="N|auto",
        convert=parse_workers,
    )
    queue: int = flag("requests that may wait for a worker; past it: 429", default=8)
    timeout: float = flag(
        "seconds from arrival to the last step; past it the request is cancelled (504)",
        default=300.0,
        metavar="SECONDS",
    )
    drain: float = flag(
        "on SIGTERM, report not ready but go on answering for this long, then finish the requests in flight "
        "and stop (longer than a balancer's health check takes to see it: a rolling restart loses no request); "
        "0: cancel them and stop at once",
        default=0.0,
        metavar="SECONDS",
    )
    max_images: int = flag("the largest n of a request", default=4, metavar="N")
    max_steps: int = flag("the largest num_inference_steps", default=100, metavar="N")
    name: str | None = flag("the base model's name in requests (default: the export directory's name)", default=None)
    precision: str = flag(
        "auto: OpenVINO's default (bf16 on a CPU with AMX or AVX512-BF16, f32 elsewhere); f32: always f32 "
        "(slower there; the images then match PyTorch fp32 closely), as xeonsd generate --precision",
        default="auto",
        choices=PRECISIONS,
    )
    write_ovms_config: Path | None = flag(
        "write an OpenVINO Model Server config (graph.pbtxt, config.json) serving the same export and "
        "adapters to DIR, and exit",
        default=None,
        metavar="DIR",
    )


@dataclass
class ServedModel:
    """The export and adapters as the pool compiles them (adapters converted into ``workdir``)."""

    export_dir: Path
    name: str
    family: FamilySpec  # the export's (xeonsd.families.of_manifest)
    shape: StaticShape
    concept_tokens: list[str]
    adapters: dict[str, tuple[Path, float]] = field(default_factory=dict)  # name -> (GenAI file, alpha)
    max_sequence_length: int | None = None  # the text encoder's prompt length (the manifest's; CLIP-only: None)
    blends: tuple[tuple[tuple[str, float], ...], ...] = ()  # --blend's keys (contracts.blend_syntax.blend_key)
    overlay: Path | None = None  # --embeds: the export with the concept added (xeonsd.openvino.overlay)
    engine: str = "genai"  # the pool that serves it: genai (an export) or torch (a diffusers pipeline directory)
    concepts: dict[str, Any] | None = None  # torch: --embeds' concept per text encoder, added at load
    # torch: the sampler arguments the served checkpoint asks for (TrainFamily.sampling of its pipeline config,
    # what the trainer's validation images and `xeonsd generate --engine torch` use: Krea 2 Turbo's 8 steps, no
    # guidance); genai: none (the family's defaults)
    sampling: dict[str, Any] = field(default_factory=dict)

    @property
    def model_names(self) -> list[str]:
        return [self.name, *self.adapters]

    @property
    def models_dir(self) -> Path:
        """What every worker compiles: the overlay holding ``--embeds``' concept, else the export."""
        return self.overlay or self.export_dir

    @property
    def references(self) -> int:
        """The reference images an edit takes: the torch engine runs an edit family's instruction edits
        (``FamilySpec.reference_images``); 0: its edits are image-to-image and inpainting (:attr:`edits`)."""
        return self.family.reference_images if self.engine == "torch" else 0

    @property
    def edits(self) -> tuple[str, ...]:
        """The image-to-image and inpainting edits served: GenAI's for the family; on the torch engine those of its
        diffusers pipelines (``FamilySpec.torch_edits``), and none for an edit family (it edits by references)."""
        if self.engine == "genai":
            return self.family.genai_edits
        return () if self.references else tuple(kind for kind, _ in self.family.torch_edits)

    @property
    def guidance_scale(self) -> float:
        """A request's default: the checkpoint's (:attr:`sampling`), else the family's pipeline's
        (``FamilySpec.guidance_scale``)."""
        return float(self.sampling.get("guidance_scale", self.family.guidance_scale))

    @property
    def default_steps(self) -> int:
        """A request's default ``num_inference_steps``: OVMS's 20, or fewer where the checkpoint asks for fewer (a
        distilled one: Krea 2 Turbo's 8)."""
        from xeonsd.serve.requests import DEFAULT_STEPS

        return min(DEFAULT_STEPS, int(self.sampling.get("num_inference_steps", DEFAULT_STEPS)))


def cpu_count() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def memory_available() -> int | None:
    """MemAvailable in bytes (Linux), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def weights_bytes(export_dir: Path) -> int:
    """The size of the weights a worker compiles."""
    files = (Path(export_dir) / c / "openvino_model.bin" for c in COMPILED)
    return sum(f.stat().st_size for f in files if f.is_file())


def compiled_pipelines(found: FamilySpec, images_per_call: int) -> tuple[str, ...]:
    """The pipelines (``generation``, ``image2image``, ``inpainting``) a worker compiles for one served model: a UNet
    family's edits are made from its inpainting pipeline, sharing its models, and so is its text-to-image pipeline
    where the batch is the edits' one (:mod:`xeonsd.serve.pool`); any other pipeline compiles on its own."""
    if "inpainting" in found.genai_edits and found.denoiser == "unet":
        return ("inpainting",) if images_per_call == 1 else ("inpainting", "generation")
    return (*found.genai_edits, "generation")


def compiled_copies(served: ServedModel) -> int:
    """The compiled copies of the models one worker holds (what ``--workers auto`` budgets memory for): the
    :func:`compiled_pipelines` of each served model (the base, each adapter and each --blend)."""
    per_model = len(compiled_pipelines(served.family, served.shape.images_per_call))
    return per_model * (1 + len(served.adapters) + len(served.blends))


def auto_workers(cores: int, weights: int = 0, available: int | None = None, copies: int = 1) -> int:
    """One worker per CORES_PER_WORKER cores, as many as MEMORY_SHARE of ``available`` bytes holds, a worker
    holding ``copies`` compiled copies of the ``weights`` (:func:`compiled_copies`)."""
    by_cores = max(1, cores // CORES_PER_WORKER)
    if not weights or available is None:
        return by_cores
    return max(1, min(by_cores, int(available * MEMORY_SHARE // (weights * PIPELINE_MEMORY * copies))))


def resolve_workers(workers: int | str, cores: int, export_dir: Path | None = None, copies: int = 1) -> int:
    count = parse_workers(workers) if isinstance(workers, str) else workers
    if count == "auto":
        weights = weights_bytes(export_dir) if export_dir is not None else 0
        return auto_workers(cores, weights, memory_available(), copies)
    if count < 1:
        raise ServeError(f"--workers must be at least 1, not {count}")
    if count > cores:
        raise ServeError(f"--workers {count} is more than the {cores} core(s) this process may use")
    return count


def check_options(opts: ServeOptions) -> None:
    """The limits and names, before the export is read."""
    for option, value, low in (
        ("--queue", opts.queue, 0),
        ("--max-images", opts.max_images, 1),
        ("--max-steps", opts.max_steps, 1),
        ("--port", opts.port, 0),
        ("--max-body-bytes", opts.max_body_bytes, 1024),
        ("--rate-limit", opts.rate_limit, 0),
    ):
        if value < low:
            raise ServeError(f"{option} must be at least {low}, not {value}")
    if opts.timeout <= 0:
        raise ServeError(f"--timeout must be positive, not {opts.timeout}")
    if not 0 < opts.read_timeout <= 3600:
        raise ServeError(f"--read-timeout must be above 0 and at most 3600 seconds, not {opts.read_timeout}")
    if not 0 <= opts.drain <= 3600:
        raise ServeError(f"--drain must be 0 (stop at once) to 3600 seconds, not {opts.drain}")
    names = [a.name for a in opts.adapters]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ServeError(f"--adapter name {dupes[0]!r} is given twice")
    if opts.precision not in PRECISIONS:
        raise ServeError(f"--precision {opts.precision!r}: choose one of {', '.join(PRECISIONS)}")
    if opts.name is not None and not NAME.match(opts.name):
        raise ServeError(f"--name {opts.name!r}: letters, digits, '.', '_' or '-' (at most 64)")
    if opts.token is not None and opts.embeds is None:
        raise ServeError("--token names the --embeds concept; give --embeds FILE too")
    if opts.embeds is not None and opts.write_ovms_config is not None:
        raise ServeError(
            "--write-ovms-config does not take --embeds: OVMS loads the export as it is (GenAI adds no embeddings "
            f"per request); bake the concept into an export, xeonsd export SRC OUT --embeds {opts.embeds}, and "
            "write OVMS's configuration for that"
        )
    blend_keys(opts)


def blend_keys(opts: ServeOptions) -> tuple[tuple[tuple[str, float], ...], ...]:
    """``--blend``'s keys, parsed as requests are (:func:`xeonsd.contracts.blend_syntax.parse_blends`)."""
    from xeonsd.contracts.blend_syntax import BlendError, parse_blends

    try:
        return parse_blends(opts.blends, {a.name: float(a.alpha) for a in opts.adapters})
    except BlendError as e:
        raise ServeError(str(e)) from None


def read_export(opts: ServeOptions) -> tuple[dict[str, Any], StaticShape, FamilySpec]:
    """The manifest, the static shape and the family; refuse an export GenAI cannot serve."""
    from xeonsd.families import of_manifest
    from xeonsd.openvino.manifest import read_manifest, static_shape

    export_dir = Path(opts.export_dir)
    manifest = read_manifest(export_dir)
    shape = static_shape(manifest)
    if shape is None:
        raise ServeError(
            f"{export_dir} has dynamic shapes; serve needs a static export (xeonsd export SRC OUT --batch-size 1)"
        )
    family = of_manifest(manifest)
    for _, tokenizer in family.text_side:
        if not (export_dir / tokenizer / "openvino_tokenizer.xml").is_file():
            raise ServeError(f"{export_dir} has no {tokenizer}/openvino_tokenizer.xml, which OpenVINO GenAI needs")
    return manifest, shape, family
