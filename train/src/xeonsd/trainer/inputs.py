"""What a run checks before a model loads: the flags, the images and their captions, the method's own checks, the
model source, the checkpoint to resume, an earlier run in ``--output_dir``, and the memory estimate."""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from xeonsd.cluster.launch import RankInfo
from xeonsd.contracts.method_names import METHODS
from xeonsd.families import REGISTRY, Family, FamilyError, detect_family
from xeonsd.families.detect import denoiser_config
from xeonsd.fsutil import atomic_path
from xeonsd.modelfiles.modelsource import check_model_source
from xeonsd.trainer import checkpoint as ckpt
from xeonsd.trainer.buckets import Buckets, assign
from xeonsd.trainer.captions import Captions, read_captions, read_references, short_tag_captions
from xeonsd.trainer.config import ConfigError, TrainConfig
from xeonsd.trainer.data import DataError, find_images
from xeonsd.trainer.flow import resolve_scheme
from xeonsd.trainer.latents import bucket_placements
from xeonsd.trainer.loss import local_num_train_timesteps, parse_timestep_range
from xeonsd.trainer.masks import find_masks
from xeonsd.trainer.methods import for_config, method_class
from xeonsd.trainer.models import model_family
from xeonsd.trainer.prior import check_prior_flags
from xeonsd.trainer.resolution import default_resolution
from xeonsd.trainer.shared_weights import shares_weights
from xeonsd.trainer.tracking import check_report_to
from xeonsd.trainer.validation import HeldOut, check_held_out, hold_out

log = logging.getLogger("xeonsd.train")  # the trainer's log lines keep one logger name


@dataclass(frozen=True)
class Inputs:
    """What ``validate`` found: the images (each checked to decode), their captions, the checkpoint to resume, and
    the base model's family (from its config files; None where a caller built the inputs without a model)."""

    images: list[Path]  # the training images (the held-out ones left out)
    captions: Captions | None
    resume: Path | None
    family: Family | None = None
    held_out: HeldOut | None = None  # the validation loss's images
    buckets: Buckets | None = None  # --buckets: each training image's aspect-ratio bucket
    class_images: list[Path] = dataclasses.field(default_factory=list)  # prior preservation's, from set-up
    # --cond_image_column: each training and held-out image's reference image (edit training on image pairs)
    references: dict[Path, tuple[Path, ...]] | None = None
    masks: dict[Path, Path] | None = None  # --masks: each training image's mask file (masked loss)


def validate(cfg: TrainConfig, info: RankInfo) -> Inputs:
    """Check everything that can be checked before a model loads."""
    check_flags(cfg, info)
    images = find_images(Path(cfg.train_data_dir))
    captions = read_captions(Path(cfg.train_data_dir), images, cfg.caption_column)
    images, captions, held_out = hold_out(cfg, images, captions)
    method_cls = for_config(cfg)
    method_cls.check(cfg, captions)
    uses_captions = method_cls.uses_captions(cfg, captions)
    check_caption_options(cfg, images, captions, uses_captions, info.is_main)
    if held_out is not None:
        check_held_out(cfg, held_out, uses_captions)
    check_model_source(cfg.pretrained_model_name_or_path, revision=cfg.revision)
    family = model_family(cfg)  # a family we do not serve is refused here, before any weight loads
    check_family_flags(cfg, family)
    check_reference_flags(cfg, family)
    check_inference_model(cfg, family)
    check_full_pipeline_loads(cfg)
    buckets = None
    if cfg.buckets:
        resolution = cfg.resolution or default_resolution(family)
        buckets = assign(images, resolution, cfg.min_bucket_reso, cfg.max_bucket_reso, cfg.bucket_reso_steps)
    masks = None
    if cfg.masks:
        resolution = cfg.resolution or default_resolution(family)
        places = bucket_placements(images, buckets, cfg.center_crop)
        masks = find_masks(Path(cfg.masks), images, resolution, cfg.center_crop, places)
    references = None
    if cfg.cond_image_column:
        most = family.spec.reference_images
        references = read_references(Path(cfg.train_data_dir), images, cfg.cond_image_column, most)
        if held_out is not None:
            held_dir = Path(cfg.validation_data_dir or cfg.train_data_dir)
            held = read_references(held_dir, held_out.images, cfg.cond_image_column, most)
            train_count, held_count = len(references[images[0]]), len(next(iter(held.values())))
            if held_count != train_count:
                raise DataError(
                    f"{held_dir}: the held-out images have {held_count} reference image(s) each, the training "
                    f"images {train_count}; give them the same number"
                )
            references |= held
    resume = None
    # Checkpoints live in rank 0's output dir (on the primary node); rank 0 reads and broadcasts the state.
    if cfg.resume_from_checkpoint and info.is_main:
        resume = ckpt.resolve_resume(cfg.resume_from_checkpoint, cfg.output_path)
    if info.is_main and resume is None and not cfg.overwrite_output_dir:
        check_no_earlier_run(cfg)
    return Inputs(images, captions, resume, family, held_out, buckets, references=references, masks=masks)


FLOW_FLAGS = ("weighting_scheme", "logit_mean", "logit_std", "mode_scale", "guidance_scale")


def check_family_flags(cfg: TrainConfig, family: Family) -> None:
    """The flags against the model's family: a flow model (FLUX.1, SD3) trains with rectified flow, so the ε/v
    tools and textual inversion are refused there, its flags anywhere else, and its image sides must pack."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    if not family.is_flow:
        given = [f"--{n}" for n in FLOW_FLAGS if getattr(cfg, n) != defaults[n]]
        if given:
            raise ConfigError(
                f"{', '.join(given)} apply to the rectified-flow models (FLUX.1, SD3); {family.label} trains with "
                "noise prediction on a DDPM schedule"
            )
        return
    what = f"{family.label} trains with rectified flow"
    if cfg.method == "textual_inversion" and family.spec.concept_layout is None:
        encoders = " + ".join(dict.fromkeys(c.removesuffix("WithProjection") for c in family.spec.encoder_classes))
        raise ConfigError(
            f"--method textual_inversion is not supported on {family.label}: no trainer trains embeddings for its "
            f"{encoders} text side; use --method lora or full"
        )
    tools = [f"--{n}" for n in ("snr_gamma", "timestep_range") if getattr(cfg, n) is not None]
    tools += ["--noise_offset"] if cfg.noise_offset else []
    if tools:
        raise ConfigError(
            f"{' and '.join(tools)} {'is an' if len(tools) == 1 else 'are'} ε/v-prediction option(s), but {what}: "
            "choose how σ is drawn and weighted with --weighting_scheme (logit_normal, mode, uniform, sigma_sqrt, "
            "cosmap)"
        )
    resolve_scheme(cfg.weighting_scheme, family.spec.weighting_scheme)
    if not cfg.logit_std > 0:
        raise ConfigError(f"--logit_std must be positive, got {cfg.logit_std}")
    step = family.pixel_multiple
    if cfg.resolution is not None and cfg.resolution % step:
        raise ConfigError(
            f"--resolution must be a multiple of {step} for {family.label} (its VAE's {family.vae_scale} times the "
            f"2x2 latent packing), got {cfg.resolution}"
        )
    if cfg.buckets and cfg.bucket_reso_steps % step:
        raise ConfigError(
            f"--bucket_reso_steps must be a multiple of {step} for {family.label} (bucket sides pack into 2x2 "
            f"latent tokens), got {cfg.bucket_reso_steps}"
        )
    if cfg.channels_last:
        raise ConfigError(f"--channels_last applies to UNets; {family.label}'s denoiser is a transformer")
    if cfg.train_text_encoder and not any(c.startswith("CLIP") for c in family.spec.encoder_classes):
        raise ConfigError(
            f"--train_text_encoder: {family.label}'s text encoder ({', '.join(family.spec.encoder_classes)}) stays "
            "frozen (its hidden states are encoded once, then it is freed); train the transformer's LoRA alone"
        )
    if cfg.method == "lora" and cfg.save_format == "kohya" and family.spec.kohya is None:
        raise ConfigError(
            f"--save_format kohya: {family.label} has no kohya layout; ComfyUI and Forge load its adapters in "
            f"diffusers' layout (the default), which {family.pipeline_class}.load_lora_weights loads"
        )


def check_inference_model(cfg: TrainConfig, family: Family) -> None:
    """``--inference_model``: a pipeline of the base model's family (told by the same detection, from its config
    files), since the adapters trained on the base go onto its denoiser; and a validation prompt for it to render."""
    if cfg.inference_model is None:
        return
    if not cfg.validation_prompt:
        raise ConfigError("--inference_model renders the validation images: give --validation_prompt too")
    try:
        found = detect_family(cfg.inference_model)
    except FamilyError as exc:
        raise ConfigError(f"--inference_model: {exc}") from exc
    if found.spec is not family.spec:
        raise ConfigError(
            f"--inference_model {cfg.inference_model} is a {found.label} pipeline ({found.pipeline_class}), but the "
            f"base model is {family.label} ({family.pipeline_class}): the adapters trained on it apply to a "
            f"{family.label} model only"
        )
    ours = denoiser_config(cfg.pretrained_model_name_or_path, family.spec, cfg.revision)
    theirs = denoiser_config(cfg.inference_model, found.spec)
    differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    if differ:
        raise ConfigError(
            f"--inference_model {cfg.inference_model}: its {found.spec.denoiser} is not the base model's shape "
            f"({', '.join(f'{k} {theirs.get(k)} against {ours.get(k)}' for k in differ)}), so the adapters do not fit it"
        )


def check_reference_flags(cfg: TrainConfig, family: Family) -> None:
    """Edit training on image pairs (``--cond_image_column``): only where the family's model takes a reference
    image (``FamilySpec.reference_images``), and not with what has no reference to give (prior preservation's class
    images, the caption draws of a text encoder that reads the references)."""
    if not cfg.cond_image_column:
        if family.spec.reference_required:
            raise ConfigError(
                f"{family.label} ({family.pipeline_class}) edits reference images and cannot run without one: train "
                "it on image pairs, --cond_image_column naming each image's reference in metadata.jsonl"
            )
        return
    if not family.spec.reference_images:
        takes = [f.label for f in REGISTRY if f.reference_images]
        raise ConfigError(
            f"--cond_image_column: {family.label} ({family.pipeline_class}) takes no reference image; edit training "
            f"on image pairs is for {', '.join(takes)}"
        )
    if cfg.with_prior_preservation:
        raise ConfigError(
            "--with_prior_preservation with --cond_image_column: the class images have no reference images; "
            "train the pairs without prior preservation"
        )
    if family.spec.training.text_reads_references:
        drawn = [f"--{n}" for n in ("caption_dropout", "shuffle_tags") if getattr(cfg, n)]
        if drawn:
            raise ConfigError(
                f"{' and '.join(drawn)} with --cond_image_column: {family.label}'s text encoder reads each prompt "
                "with its reference images, encoded once per image; captions drawn per step have no such row"
            )


def check_full_pipeline_loads(cfg: TrainConfig) -> None:
    """--method full saves a complete pipeline, re-reading the base's other components with ``from_pretrained``: a
    component whose class cannot be imported here (a library's placeholder for a missing backend: FLUX.2 [dev]'s
    ``model_index.json`` names a ``PixtralProcessor``, which transformers builds only with torchvision) would fail
    that save after the training, so it is refused now. A local pipeline directory's (a Hub id's is read then)."""
    index_file = Path(cfg.pretrained_model_name_or_path) / "model_index.json"
    if cfg.method != "full" or not index_file.is_file():
        return
    for name, entry in sorted(json.loads(index_file.read_text()).items()):
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or None in entry:
            continue
        library, cls = entry
        try:
            found = getattr(importlib.import_module(library), cls, None)
        except ImportError:
            continue  # a pipeline-local module: from_pretrained says what it needs
        backends = getattr(found, "_backends", None) if type(found).__name__ == "DummyObject" else None
        if backends:
            raise ConfigError(
                f"--method full saves a complete pipeline, reading the base's {name} ({cls}, from {library}) again, "
                f"which needs {', '.join(backends)}, not installed here: install it, or train a LoRA (--method lora)"
            )


def check_flags(cfg: TrainConfig, info: RankInfo) -> None:
    """The flags' values on their own, and ``--world_size`` against the launcher."""
    check_report_to(cfg)
    if cfg.use_ipex == "on" and shares_weights(cfg.share_weights, info.local_world_size):
        raise ConfigError(
            "--use_ipex on rewrites (prepacks) the UNet's and VAE's weights in each rank, but --share_weights maps "
            "them read-only from one copy per node: add --share_weights off to use IPEX"
        )
    if cfg.mixed_precision == "fp16":
        raise ConfigError(
            "--mixed_precision fp16 is not supported on CPU (no fp16 autocast/AMX path for training); "
            "use --mixed_precision bf16 (AMX) or no"
        )
    if cfg.resolution is not None and (cfg.resolution <= 0 or cfg.resolution % 8):
        raise ConfigError(
            f"--resolution must be a positive multiple of 8 (the VAE downsamples by 8), got {cfg.resolution}"
        )
    for name in ("train_batch_size", "gradient_accumulation_steps", "max_train_steps", "stats_every"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name} must be at least 1, got {getattr(cfg, name)}")
    if not 0 <= cfg.profile_step <= cfg.max_train_steps:
        raise ConfigError(
            f"--profile_step must be 0 (off) or a step of the run (1-{cfg.max_train_steps}), got {cfg.profile_step}"
        )
    if cfg.learning_rate <= 0:
        raise ConfigError(f"--learning_rate must be positive, got {cfg.learning_rate}")
    if cfg.snr_gamma is not None and not cfg.snr_gamma > 0:
        raise ConfigError(f"--snr_gamma must be positive (5 is the paper's), got {cfg.snr_gamma}")
    if not 0 <= cfg.noise_offset < float("inf"):
        raise ConfigError(f"--noise_offset must be 0 (off) or positive, got {cfg.noise_offset}")
    # A local model's scheduler bounds it now; a Hub id's once its scheduler has loaded (job.py).
    parse_timestep_range(cfg.timestep_range, local_num_train_timesteps(cfg.pretrained_model_name_or_path))
    bucket_flags = [f"--{n}" for n in ("min_bucket_reso", "max_bucket_reso") if getattr(cfg, n) is not None]
    bucket_flags += ["--bucket_reso_steps"] if cfg.bucket_reso_steps != 64 else []
    if bucket_flags and not cfg.buckets:
        raise ConfigError(f"{' and '.join(bucket_flags)} shape the aspect-ratio buckets: add --buckets")
    check_prior_flags(cfg)
    check_latent_cache_dir(cfg)
    if cfg.world_size is not None and cfg.world_size != info.world_size:
        raise ConfigError(
            f"--world_size {cfg.world_size} does not match the launcher ({info.launcher}), which reports "
            f"{info.world_size} rank(s) for rank {info.rank}; check mpirun -n / the nodefile"
        )


def check_latent_cache_dir(cfg: TrainConfig) -> None:
    """--latent_cache_dir: created if missing and writable (one rank per node writes the files its node lacks, after
    the encode), so that a wrong path fails here and not once the cache is built."""
    if not cfg.latent_cache_dir:
        return
    cache_dir = Path(cfg.latent_cache_dir).expanduser()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--latent_cache_dir {cache_dir} cannot be created: {exc}") from exc
    if not os.access(cache_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"--latent_cache_dir {cache_dir} is not writable: make it writable or choose another")


def check_caption_options(
    cfg: TrainConfig, images: list[Path], captions: Captions | None, uses_captions: bool, is_main: bool
) -> None:
    """--caption_dropout, --shuffle_tags, --keep_tokens, --caption_prefix: their values, and captions where they
    need them; rank 0 warns about the images with fewer tags than --keep_tokens."""
    if not 0 <= cfg.caption_dropout < 1:
        raise ConfigError(f"--caption_dropout is a probability in [0, 1) (0: off), got {cfg.caption_dropout}")
    if cfg.keep_tokens < 0:
        raise ConfigError(f"--keep_tokens must be 0 or more, got {cfg.keep_tokens}")
    if cfg.keep_tokens and not cfg.shuffle_tags:
        raise ConfigError("--keep_tokens keeps tags in place when --shuffle_tags shuffles them: add --shuffle_tags")
    need = [f for f in ("shuffle_tags", "caption_prefix") if getattr(cfg, f)]
    if need and not uses_captions:
        instead = method_class(cfg.method).prompt_source
        raise ConfigError(
            " and ".join(f"--{f}" for f in need) + f" work on captions, but this run trains on {instead} "
            f"(--captions {cfg.captions}; {cfg.train_data_dir} needs metadata.jsonl, a .txt beside each image or "
            "captions.txt)"
        )
    if cfg.keep_tokens and captions is not None and is_main:
        short = short_tag_captions(captions, images, cfg.keep_tokens)
        if short:
            log.warning(
                "--keep_tokens %d: %d image(s) have fewer tags, all of theirs stay in place: %s",
                cfg.keep_tokens,
                len(short),
                ", ".join(short[:10]) + (f" and {len(short) - 10} more" if len(short) > 10 else ""),
            )


def check_no_earlier_run(cfg: TrainConfig) -> None:
    """Refuse an ``--output_dir`` that holds another run's results, metrics or checkpoints."""
    earlier = {"metrics.jsonl", "metrics.partial.jsonl"}
    for name in METHODS:
        earlier.update(method_class(name).outputs, getattr(method_class(name), "other_outputs", ()))
    found = [n for n in sorted(earlier) if (cfg.output_path / n).exists()]
    found += [p.name for _, p in ckpt.list_checkpoints(cfg.output_path)]
    if found:
        raise ConfigError(
            f"--output_dir {cfg.output_dir} already holds a run ({', '.join(found[:4])}); continue it with "
            "--resume_from_checkpoint latest, replace it with --overwrite_output_dir, or choose another --output_dir"
        )


def check_memory(cfg: TrainConfig, info: RankInfo, inputs: Inputs) -> None:
    """Estimate this rank's peak memory; refuse a run whose ranks on this node would not fit in its free memory.
    With --dry-run, rank 0 prints the estimate."""
    from xeonsd.trainer import memory

    prompts = len(inputs.captions.texts) if inputs.captions else 1
    try:
        est = memory.estimate(cfg, cfg.method, len(inputs.images), prompts, info.world_size)
    except Exception as exc:  # noqa: BLE001 - an estimate that cannot be made must not stop a run
        if cfg.dry_run:
            raise ConfigError(f"cannot estimate the memory of this run: {exc}") from exc
        log.warning("no memory estimate (%s); training without the check", exc)
        return
    free = memory.available_memory()
    shared = shares_weights(cfg.share_weights, info.local_world_size)
    if info.is_main:
        line = f"estimated peak memory per rank: {est.describe()}"
        node = est.per_node(info.local_world_size, shared)
        line += f"; this node: {node / memory.GB:.2f} GB for {info.local_world_size} rank(s)"
        line += " with shared frozen weights" if shared else ""
        if free is not None:
            line += f", {free / memory.GB:.1f} GB free"
        (print if cfg.dry_run else log.info)(line)
    problem = memory.check_fits(est, info.local_world_size, free, shared)
    if problem:
        raise ConfigError(problem)
    if info.is_main and not cfg.dry_run:
        cfg.output_path.mkdir(parents=True, exist_ok=True)
        with atomic_path(cfg.output_path / memory.ESTIMATE_FILE) as tmp:
            tmp.write_text(json.dumps(est.as_dict()))
