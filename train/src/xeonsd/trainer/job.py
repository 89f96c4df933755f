"""A training job, and ``setup``, which builds it from the configuration: this rank's place in the cluster, the
models and the method, the optimizer and its schedule, the checkpoint resumed, the latent and prompt caches and
the sampling plan. (This rank's status file and its log prefix exist before the job does: :mod:`.rank_io`.)"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from xeonsd.cluster.distributed import CollectiveTimeout, collective, node_address, take_the_job_down
from xeonsd.cluster.launch import RankInfo, Timeouts
from xeonsd.cluster.placement import Placement
from xeonsd.cpu import cpu_info
from xeonsd.jobs.status_file import RankStatusFile
from xeonsd.modelfiles.modelsource import model_fingerprint
from xeonsd.trainer import checkpoint as ckpt
from xeonsd.trainer.buckets import BUCKET_OPTIONS, BucketBatches, Buckets
from xeonsd.trainer.conditioning import PromptConditioning
from xeonsd.trainer.config import TrainConfig
from xeonsd.trainer.data import FLIP_P, SamplingPlan, flips
from xeonsd.trainer.encoded_prompts import encode_prompts
from xeonsd.trainer.inputs import FLOW_FLAGS, Inputs
from xeonsd.trainer.latents import LatentTable
from xeonsd.trainer.loss import parse_timestep_range
from xeonsd.trainer.methods import Method, for_config
from xeonsd.trainer.methods.base import PlainText
from xeonsd.trainer.models import Models, load_denoiser, load_models, loads_in_phases
from xeonsd.trainer.optim import make_optimizer
from xeonsd.trainer.prior import ClassRendererOpener, PriorData, build_prior, ensure_class_images
from xeonsd.trainer.prompt_tables import PromptTable
from xeonsd.trainer.rng import Stream, stream_seed
from xeonsd.trainer.shared_weights import SharedStore
from xeonsd.trainer.step import LossInputs
from xeonsd.trainer.validation import ValidationSet, build_validation

log = logging.getLogger("xeonsd.train")  # the trainer's log lines keep one logger name
# A rank that lost a peer waits this long before ending the job, so that the other survivors report it too.
ABORT_GRACE_S = 3.0
# The loss, noise and caption options (and the flow ones, FLOW_FLAGS): a resumed run that changes one continues on
# another trajectory (a warning).
LOSS_OPTIONS = ("snr_gamma", "noise_offset", "timestep_range", "caption_dropout", "shuffle_tags", "keep_tokens")
LOSS_OPTIONS += ("masks",)


@dataclass(frozen=True)
class RunSpec:
    """What the run is: its configuration, its seed (the same on every rank), the step it starts at, and the
    fingerprint of the base model (checked against a checkpoint's)."""

    cfg: TrainConfig
    seed: int
    start_step: int
    base_model: str


@dataclass(frozen=True)
class Training:
    """What is trained and how: the models, the method's trainable part, and what updates it."""

    models: Models
    method: Method
    unet: torch.nn.Module  # the UNet the steps call (DistributedDataParallel-wrapped when the method asks)
    optimizer: torch.optim.Optimizer
    lr_scheduler: object


@dataclass(frozen=True)
class TrainingData:
    """What the steps draw from: the prompts, their text conditioning, the latents, and the sampling plan; and the
    validation loss's held-out images."""

    prompts: PromptTable
    text: PromptConditioning  # the family's (its FamilySpec.training)
    latents: LatentTable
    plan: SamplingPlan
    validation: ValidationSet | None = None  # the held-out images of the validation loss
    buckets: Buckets | None = None  # --buckets: the aspect-ratio buckets and their images
    prior: PriorData | None = None  # --with_prior_preservation's class images


@dataclass(frozen=True)
class Cluster:
    """This rank among the others: who it is, the process-group backend, the collective timeouts and watchdog,
    and its status file."""

    info: RankInfo
    backend: str | None
    timeouts: Timeouts  # read from the environment once, in run()
    timeout: CollectiveTimeout
    status: RankStatusFile  # this rank's status/rank-<r>.json (xeonsd.jobs.status_file)


@dataclass(frozen=True)
class Job:
    """Everything the steps need, built by ``setup``, in four parts: what the run is (``run``), what is trained
    and how (``training``), what the steps draw from (``data``), and this rank among the others (``cluster``)."""

    run: RunSpec
    training: Training
    data: TrainingData
    cluster: Cluster

    @property
    def world(self) -> int:
        return self.cluster.info.world_size

    @property
    def is_main(self) -> bool:
        return self.cluster.info.is_main

    @property
    def global_batch(self) -> int:
        return self.world * self.run.cfg.train_batch_size

    @property
    def ddp(self) -> bool:
        return self.training.unet is not self.training.models.unet

    @property
    def sharded(self) -> bool:
        """--fsdp on 2+ ranks: every denoiser call, checkpoint and save is collective."""
        return self.training.method.sharded

    def loss_inputs(self) -> LossInputs:
        """What the training examples' loss reads (:func:`xeonsd.trainer.step.step_loss`)."""
        cfg = self.run.cfg
        return LossInputs(
            models=self.training.models,
            unet=self.training.unet,
            text=self.data.text,
            latents=self.data.latents,
            prior=self.data.prior,
            snr_gamma=cfg.snr_gamma,
            channels_last=cfg.channels_last,
        )

    def allreduce_bytes(self) -> int:
        """Bytes each rank all-reduces per optimizer step: the gradients, and the loss. Sharded (--fsdp): the
        whole fp32 weights all-gathered twice (forward and backward) and the gradients reduce-scattered."""
        whole = sum(p.numel() for p in self.training.method.parameters())  # a shard's DTensor: the whole shape
        return (whole * (3 if self.sharded else 1) + 1) * 4


def setup(
    cfg: TrainConfig,
    info: RankInfo,
    backend: str | None,
    placement: Placement,
    inputs: Inputs,
    timeouts: Timeouts,
    status: RankStatusFile,
    open_class_renderer: ClassRendererOpener | None = None,  # --class_export's OpenVINO side, from the CLI
    store: SharedStore | None = None,  # the node's shared frozen weights (--share_weights)
) -> Job:
    """Load the models, make the method and its optimizer, resume, build the caches: the job, on every rank. When
    the prompts do not need the method (:func:`loads_in_phases`), the denoiser loads last: after the prompts are
    encoded and the latents cached, once a long text encoder and the VAE are freed."""
    method_cls = for_config(cfg)
    text_first = method_cls.text_first(cfg)
    phased = loads_in_phases(cfg, text_first is not None, store)
    t0 = time.perf_counter()
    models = load_models(cfg, method_cls.unet_fp32, inputs.family, store, denoiser=not phased)
    load_s = time.perf_counter() - t0
    _log_placement(cfg, info, backend, placement, models)
    if cfg.with_prior_preservation:  # from the base model, before the method or a checkpoint changes it
        inputs = dataclasses.replace(inputs, class_images=ensure_class_images(cfg, models, info, open_class_renderer))
    base_model = model_fingerprint(cfg.pretrained_model_name_or_path, cfg.revision)
    resume_state = _shared_resume_state(inputs.resume, info.world_size)
    seed = _shared_seed(cfg, info, resume_state)
    data = None
    if phased:
        data = _prepare_data(cfg, info, models, text_first, inputs, seed, load_s)
        t1 = time.perf_counter()
        load_denoiser(cfg, models, method_cls.unet_fp32)
        log.info("the denoiser loaded in %.1f s, after the prompts and latents", time.perf_counter() - t1)
    if store is not None and store.mapped:
        log.info(
            "frozen weights mapped from %s, shared by the node's ranks: %s",
            store.directory,
            ", ".join(f"{n} {b / 1e9:.2f} GB" for n, b in store.mapped.items()),
        )
    with torch.random.fork_rng():  # new weights (LoRA's) start the same on every rank and in every run of a seed
        torch.manual_seed(stream_seed(seed, Stream.METHOD_INIT))
        method = method_cls(cfg, models)
    optimizer, lr_scheduler = make_optimizer(cfg, method, info.world_size)
    start_step = 0
    if resume_state is not None:
        start_step = _resume(cfg, info, inputs.resume, resume_state, base_model, method, optimizer, lr_scheduler)
    del resume_state
    if data is None:
        data = _prepare_data(cfg, info, models, method, inputs, seed, load_s)
    trainable = sum(p.numel() for p in method.parameters())
    log.info(
        "%s: %d trainable parameters; prompts: %d from %s",
        cfg.method,
        trainable,
        len(data.prompts.texts),
        data.prompts.source,
    )
    training = Training(
        models=models,
        method=method,
        unet=_step_unet(models, method, info.world_size),
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
    )
    cluster = Cluster(
        info=info,
        backend=backend,
        timeouts=timeouts,
        timeout=CollectiveTimeout(info.world_size, timeouts.setup_s, _lost_peer_exit(info, status)),
        status=status,
    )
    run = RunSpec(cfg=cfg, seed=seed, start_step=start_step, base_model=base_model)
    return Job(run=run, training=training, data=data, cluster=cluster)


def _log_placement(cfg: TrainConfig, info: RankInfo, backend: str | None, placement: Placement, models: Models) -> None:
    """Where this rank runs and how (one line per rank), and a warning when bf16 is emulated."""
    native = cpu_info().native_bf16
    log.info(
        "node=%s pid=%d launcher=%s backend=%s threads=%d cores=%s dtype=%s bf16_hw=%s ipex=%s local_rank=%d/%d "
        "method=%s",
        node_address(),
        os.getpid(),
        info.launcher,
        backend or "none (single process)",
        placement.threads,
        ",".join(map(str, placement.cpus)),
        str(models.weight_dtype).replace("torch.", ""),
        native or "none",
        "on" if models.ipex else "off",
        info.local_rank,
        info.local_world_size,
        cfg.method,
    )
    if models.weight_dtype == torch.bfloat16 and native is None:
        log.warning(
            "--mixed_precision bf16 on a CPU without AMX or AVX512-BF16 (%s): bf16 matmuls are emulated and far "
            "slower than fp32 here; use --mixed_precision no on this machine",
            cpu_info().model,
        )


def _shared_resume_state(resume_path: Path | None, world: int) -> dict | None:
    """Rank 0's checkpoint state (or None), on every rank."""
    state = ckpt.load_checkpoint(resume_path) if resume_path else None
    if world > 1:
        box = [state]
        with collective("broadcast of the checkpoint"):
            torch.distributed.broadcast_object_list(box, src=0)
        state = box[0]
    return state


def _shared_seed(cfg: TrainConfig, info: RankInfo, resume_state: dict | None) -> int:
    if resume_state is not None:
        return int(resume_state["seed"])
    if cfg.seed is not None:
        return cfg.seed
    chosen = torch.tensor([secrets.randbelow(2**31) if info.is_main else 0], dtype=torch.int64)
    if info.world_size > 1:
        with collective("broadcast of the seed"):
            torch.distributed.broadcast(chosen, src=0)
    return int(chosen.item())


def _resume(
    cfg: TrainConfig,
    info: RankInfo,
    where: Path | None,
    state: dict,
    base_model: str,
    method: Method,
    optimizer: torch.optim.Optimizer,
    lr_scheduler,
) -> int:
    """Load a checkpoint's state into the method, the optimizer and the schedule; returns its step."""
    ckpt.check_belongs(state, where or Path("?"), cfg.method, base_model)
    method.load_state(state["method_state"], str(where))
    method.load_optimizer_state(optimizer, state["optimizer"])
    lr_scheduler.load_state_dict(state["lr_scheduler"])
    start_step = int(state["step"])
    global_batch = info.world_size * cfg.train_batch_size
    if state.get("global_batch") != global_batch:
        log.warning("resuming with global batch %d (checkpoint used %s)", global_batch, state.get("global_batch"))
    saved = state.get("config") or {}
    for name in LOSS_OPTIONS + FLOW_FLAGS + BUCKET_OPTIONS:
        if name in saved and saved[name] != getattr(cfg, name):
            log.warning("resuming with --%s %s (checkpoint used %s)", name, getattr(cfg, name), saved[name])
    log.info("resumed from %s at step %d", where, start_step)
    return start_step


def _prepare_data(
    cfg: TrainConfig,
    info: RankInfo,
    models: Models,
    method: Method | PlainText,
    inputs: Inputs,
    seed: int,
    load_s: float,
) -> TrainingData:
    """The method's prompts and their conditioning (every table before any image is encoded), the latents (the
    VAE dropped when nothing needs it any more), and the sampling plan; logs the start-up's split (the models'
    load took ``load_s``). ``method``: the method, or its prompts' side before it exists (phased loading)."""
    world = info.world_size
    prompts = method.prompts(inputs.captions)
    if inputs.references:  # edit training: the validation images are edits of the first image's references
        models.sample_reference = inputs.references[inputs.images[0]]
        prompts = models.training.with_references(prompts, [inputs.references[p] for p in inputs.images])
    t0 = time.perf_counter()
    texts = encode_prompts(cfg, info, models, method, inputs, prompts, seed)
    t1 = time.perf_counter()
    latents = LatentTable.build(
        cfg, models, inputs.images, info.rank, info.local_rank, world, inputs.buckets, inputs.references, inputs.masks
    )
    t2 = time.perf_counter()
    if inputs.masks:
        log.info(
            "masked loss: %d mask(s) from %s at the latents' size, mirrored with their images; the validation loss "
            "stays unmasked",
            len(inputs.masks),
            cfg.masks,
        )
    batches = BucketBatches.for_run(inputs.buckets, models.vae, world * cfg.train_batch_size, models.training)
    num_timesteps = models.noise_scheduler.config.num_train_timesteps
    timestep_range = parse_timestep_range(cfg.timestep_range, num_timesteps)
    validation = build_validation(
        cfg, info, models, inputs.held_out, texts.held, seed, timestep_range or (0, num_timesteps), inputs.references
    )
    log.info(
        "start-up: models loaded in %.1f s; prepared %d latent inputs in %.1f s and %d prompts in %.1f s (%s)",
        load_s,
        latents.inputs,
        t2 - t1,
        len(prompts.texts),
        t1 - t0,
        "encoded once" if texts.train.table is not None else "tokenized; encoded every step",
    )
    plan = SamplingPlan(
        seed=seed,
        num_images=len(inputs.images),
        num_templates=prompts.num_templates,
        num_timesteps=num_timesteps,
        latent_shape=latents.shape,
        flip_p=FLIP_P if flips(cfg) else 0.0,
        timestep_range=timestep_range,
        noise_offset=cfg.noise_offset,
        buckets=batches,
        flow=models.flow,
    )
    prior = None
    if inputs.class_images:
        prior = build_prior(cfg, info, models, inputs.class_images, seed, plan, texts.prior)
    if cfg.latent_cache and not cfg.validation_prompt:  # nothing decodes or encodes from here on
        models.free("vae")
    return TrainingData(
        prompts=prompts,
        text=texts.train,
        latents=latents,
        plan=plan,
        validation=validation,
        buckets=inputs.buckets,
        prior=prior,
    )


def _step_unet(models: Models, method: Method, world: int) -> torch.nn.Module:
    """The UNet the steps call: wrapped in DistributedDataParallel on 2+ ranks when the method trains most of it."""
    module = method.ddp_module()
    if module is None or world == 1:
        return models.unet
    from torch.nn.parallel import DistributedDataParallel

    with collective("DistributedDataParallel set-up"):
        return DistributedDataParallel(module, broadcast_buffers=False, gradient_as_bucket_view=True)


def _lost_peer_exit(info: RankInfo, status: RankStatusFile):
    """What the collective watchdog does when a collective waits past its limit: report it as any lost peer is
    reported (the log line, and the status file with kind ``timeout``), ask the launcher to end the job, and
    leave (the blocked collective never returns)."""

    def expire(message: str) -> None:
        status.fail("timeout", message)
        where = f"rank {info.rank}/{info.world_size} on {node_address()}"
        log.error("xeonsd train: error: %s: %s", where, message)  # a record: the quiet console shows it too
        take_the_job_down(info, 2, grace_s=ABORT_GRACE_S)
        os._exit(2)

    return expire
