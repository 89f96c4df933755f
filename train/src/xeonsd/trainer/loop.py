"""``xeonsd train``: fine-tune Stable Diffusion on CPUs, data-parallel over MPI ranks.

One loop for every method (:mod:`xeonsd.trainer.methods`): ``setup`` (ranks, models, the method's trainable part, the
latent and prompt caches, optimizer, resume) → ``fit`` (per step: each rank's share of the global batch, loss,
backward, gradient all-reduce, optimizer, metrics, checkpoint) → ``save`` (the method's result, metrics, loss
plot). Rank 0 writes every file; every rank logs with its rank in the prefix and keeps its own status file on its
node (``status/rank-<r>.json``, :mod:`xeonsd.cluster.job_status`: state, step, and the kind of error that ended it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import secrets
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from xeonsd.cluster.distributed import (
    CollectiveTimeout,
    DistributedError,
    PeerLostError,
    RankInfo,
    Timeouts,
    all_gather_floats,
    all_gather_strings,
    all_reduce_mean_,
    barrier,
    collective,
    destroy_process_group,
    detect_ranks,
    init_process_group,
    node_address,
    place_rank,
    take_the_job_down,
)
from xeonsd.cluster.job_status import RankStatus, RankStatusFile, StatusFileError, attempt_from_env
from xeonsd.cluster.rank_stats import Interval, RankClock, StragglerWatch, node_names, summarize
from xeonsd.cluster.run_files import train_summary
from xeonsd.cpu import cpu_info
from xeonsd.flops import allreduced_elements, count_attention
from xeonsd.method_names import METHODS
from xeonsd.modelsource import ModelSourceError, check_model_source, model_fingerprint
from xeonsd.trainer import checkpoint as ckpt
from xeonsd.trainer.captions import Captions, read_captions
from xeonsd.trainer.conditioning import PromptConditioning
from xeonsd.trainer.config import ConfigError, TrainConfig, parse_config
from xeonsd.trainer.data import DataError, SamplingPlan, find_images, mix
from xeonsd.trainer.embeddings import ConceptError
from xeonsd.trainer.latents import LatentTable
from xeonsd.trainer.methods import Method, for_config, method_class
from xeonsd.trainer.metrics import MetricsLog, plot_loss, result_bytes, write_summary
from xeonsd.trainer.models import Models, autocast, load_models, render_validation
from xeonsd.trainer.prompts import PromptTable

log = logging.getLogger("xeonsd.trainer.loop")
# A rank that lost a peer waits this long before ending the job, so that the other survivors report it too.
ABORT_GRACE_S = 3.0

BAD_INPUT = (ConfigError, ModelSourceError, DataError, ConceptError, ckpt.CheckpointError, DistributedError)


@dataclass(frozen=True)
class Inputs:
    """What ``validate`` found: the images (each checked to decode), their captions, the checkpoint to resume."""

    images: list[Path]
    captions: Captions | None
    resume: Path | None


def validate(cfg: TrainConfig, info: RankInfo) -> Inputs:
    """Check everything that can be checked before a model loads."""
    if cfg.mixed_precision == "fp16":
        raise ConfigError(
            "--mixed_precision fp16 is not supported on CPU (no fp16 autocast/AMX path for training); "
            "use --mixed_precision bf16 (AMX) or no"
        )
    if cfg.resolution <= 0 or cfg.resolution % 8:
        raise ConfigError(
            f"--resolution must be a positive multiple of 8 (the VAE downsamples by 8), got {cfg.resolution}"
        )
    for name in ("train_batch_size", "gradient_accumulation_steps", "max_train_steps", "stats_every"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name} must be at least 1, got {getattr(cfg, name)}")
    if cfg.learning_rate <= 0:
        raise ConfigError(f"--learning_rate must be positive, got {cfg.learning_rate}")
    if cfg.world_size is not None and cfg.world_size != info.world_size:
        raise ConfigError(
            f"--world_size {cfg.world_size} does not match the launcher ({info.launcher}), which reports "
            f"{info.world_size} rank(s) for rank {info.rank}; check mpirun -n / the nodefile"
        )
    images = find_images(Path(cfg.train_data_dir))
    captions = read_captions(Path(cfg.train_data_dir), images, cfg.caption_column)
    for_config(cfg).check(cfg, captions)
    check_model_source(cfg.pretrained_model_name_or_path, revision=cfg.revision)
    resume = None
    # Checkpoints live in rank 0's output dir (on the primary node); rank 0 reads and broadcasts the state.
    if cfg.resume_from_checkpoint and info.is_main:
        resume = ckpt.resolve_resume(cfg.resume_from_checkpoint, cfg.output_path)
    earlier = {"metrics.jsonl", "metrics.partial.jsonl"}
    for name in METHODS:
        earlier.update(method_class(name).outputs)
    found = [n for n in sorted(earlier) if (cfg.output_path / n).exists()]
    found += [p.name for _, p in ckpt.list_checkpoints(cfg.output_path)]
    if info.is_main and found and resume is None and not cfg.overwrite_output_dir:
        raise ConfigError(
            f"--output_dir {cfg.output_dir} already holds a run ({', '.join(found[:4])}); continue it with "
            "--resume_from_checkpoint latest, replace it with --overwrite_output_dir, or choose another --output_dir"
        )
    return Inputs(images, captions, resume)


class _RankFilter(logging.Filter):
    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.prefix = f"[rank {rank}/{world}]"

    def filter(self, record: logging.LogRecord) -> bool:
        record.rankprefix = self.prefix
        return True


def _setup_logging(info: RankInfo) -> None:
    root = logging.getLogger()
    for h in root.handlers:
        h.addFilter(_RankFilter(info.rank, info.world_size))
        h.setFormatter(logging.Formatter("%(asctime)s %(rankprefix)s %(levelname)s %(name)s: %(message)s"))
    # Library chatter (loading bars, warnings about unused processors) only from rank 0.
    if not info.is_main:
        for name in ("diffusers", "transformers", "peft"):
            logging.getLogger(name).setLevel(logging.ERROR)


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


@dataclass
class Job:
    """Everything the steps need, built by ``setup``."""

    cfg: TrainConfig
    info: RankInfo
    backend: str | None
    models: Models
    method: Method
    prompts: PromptTable
    text: PromptConditioning
    latents: LatentTable
    plan: SamplingPlan
    unet: torch.nn.Module  # the UNet the steps call (DistributedDataParallel-wrapped when the method asks)
    optimizer: torch.optim.Optimizer
    lr_scheduler: object
    seed: int
    start_step: int
    base_model: str
    timeouts: Timeouts  # read from the environment once, in run()
    timeout: CollectiveTimeout
    status: RankStatusFile  # this rank's status/rank-<r>.json (xeonsd.cluster.job_status)
    metrics: MetricsLog | None = None  # rank 0's, from the first step on

    @property
    def world(self) -> int:
        return self.info.world_size

    @property
    def global_batch(self) -> int:
        return self.world * self.cfg.train_batch_size

    @property
    def ddp(self) -> bool:
        return self.unet is not self.models.unet

    def allreduce_bytes(self) -> int:
        """Bytes each rank all-reduces per optimizer step: the gradients, and the loss."""
        return (sum(p.numel() for p in self.method.parameters()) + 1) * 4


def start_status(cfg: TrainConfig, info: RankInfo) -> RankStatusFile:
    """This rank's status file (``<output_dir>/status/rank-<r>.json`` on its own node), in state ``starting``."""
    try:
        attempt = attempt_from_env()
    except StatusFileError as exc:
        raise ConfigError(str(exc)) from exc
    address = node_address()
    status = RankStatus(rank=info.rank, world=info.world_size, node=node_names().get(address, address),
                        address=address, pid=os.getpid(), state="starting", step=0, updated=time.time(),
                        attempt=attempt)  # fmt: skip
    return RankStatusFile(cfg.output_path, status)


def run(cfg: TrainConfig, status: RankStatusFile | None) -> dict:
    """Train; returns a summary dict. Raises one of BAD_INPUT on bad input. ``status`` is None only for a dry
    run (which trains nothing)."""
    info = detect_ranks()
    _setup_logging(info)
    inputs = validate(cfg, info)
    timeouts = Timeouts.from_env()
    if cfg.mixed_precision == "auto":
        cfg = dataclasses.replace(cfg, mixed_precision="bf16" if cpu_info().native_bf16 else "no")
    check_memory(cfg, info, inputs)
    if cfg.dry_run:
        return {"dry_run": True}
    assert status is not None, "a training run reports its status"
    status.accept()
    placement = place_rank(info)
    backend = init_process_group(info, setup_timeout_s=timeouts.setup_s)
    try:
        job = setup(cfg, info, backend, placement, inputs, timeouts, status)
        step_times = fit(job)
        return save(job, step_times)
    finally:
        destroy_process_group()


def check_memory(cfg: TrainConfig, info: RankInfo, inputs: Inputs) -> None:
    """Estimate this rank's peak memory; refuse a run whose ranks on this node would not fit in its free memory.
    With --dry-run, rank 0 prints the estimate."""
    from xeonsd.trainer import memory

    prompts = len(inputs.captions.texts) if inputs.captions else 1
    try:
        est = memory.estimate(cfg, cfg.method, len(inputs.images), prompts)
    except Exception as exc:  # noqa: BLE001 - an estimate that cannot be made must not stop a run
        if cfg.dry_run:
            raise ConfigError(f"cannot estimate the memory of this run: {exc}") from exc
        log.warning("no memory estimate (%s); training without the check", exc)
        return
    free = memory.available_memory()
    if info.is_main:
        line = f"estimated peak memory per rank: {est.describe()}"
        if free is not None:
            line += f"; {info.local_world_size} rank(s) on this node, {free / memory.GB:.1f} GB free"
        (print if cfg.dry_run else log.info)(line)
    problem = memory.check_fits(est, info.local_world_size, free)
    if problem:
        raise ConfigError(problem)


def setup(
    cfg: TrainConfig, info: RankInfo, backend: str | None, placement, inputs: Inputs, timeouts, status: RankStatusFile
) -> Job:
    world = info.world_size
    method_cls = for_config(cfg)
    models = load_models(cfg, unet_fp32=method_cls.unet_fp32)
    native = cpu_info().native_bf16
    log.info(
        "node=%s pid=%d launcher=%s backend=%s threads=%d cores=%s dtype=%s bf16_hw=%s ipex=%s local_rank=%d/%d "
        "method=%s",
        node_address(), os.getpid(), info.launcher, backend or "none (single process)", placement.threads,
        ",".join(map(str, placement.cpus)), str(models.weight_dtype).replace("torch.", ""), native or "none",
        "on" if models.ipex else "off", info.local_rank, info.local_world_size, cfg.method,
    )  # fmt: skip
    if models.weight_dtype == torch.bfloat16 and native is None:
        log.warning(
            "--mixed_precision bf16 on a CPU without AMX or AVX512-BF16 (%s): bf16 matmuls are emulated and far "
            "slower than fp32 here; use --mixed_precision no on this machine",
            cpu_info().model,
        )
    base_model = model_fingerprint(cfg.pretrained_model_name_or_path, cfg.revision)
    resume_state = _shared_resume_state(inputs.resume, world)
    seed = _shared_seed(cfg, info, resume_state)
    with torch.random.fork_rng():  # new weights (LoRA's) start the same on every rank and in every run of a seed
        torch.manual_seed(mix(seed, 3))
        method = method_cls(cfg, models)
    params = method.parameters()
    lr = cfg.learning_rate
    if cfg.scale_lr:
        lr = lr * cfg.gradient_accumulation_steps * cfg.train_batch_size * world
    optimizer = torch.optim.AdamW(
        params, lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.adam_weight_decay, eps=cfg.adam_epsilon
    )
    from diffusers.optimization import get_scheduler

    lr_scheduler = get_scheduler(
        cfg.lr_scheduler, optimizer=optimizer,
        num_warmup_steps=cfg.lr_warmup_steps, num_training_steps=cfg.max_train_steps,
    )  # fmt: skip
    start_step = 0
    if resume_state is not None:
        ckpt.check_belongs(resume_state, inputs.resume or Path("?"), cfg.method, base_model)
        method.load_state(resume_state["method_state"], str(inputs.resume))
        optimizer.load_state_dict(resume_state["optimizer"])
        lr_scheduler.load_state_dict(resume_state["lr_scheduler"])
        start_step = int(resume_state["step"])
        if resume_state.get("global_batch") != world * cfg.train_batch_size:
            log.warning("resuming with global batch %d (checkpoint used %s)", world * cfg.train_batch_size,
                        resume_state.get("global_batch"))  # fmt: skip
        log.info("resumed from %s at step %d", inputs.resume, start_step)
    del resume_state

    prompts = method.prompts(inputs.captions)
    log.info("%s: %d trainable parameters; prompts: %d from %s", cfg.method, sum(p.numel() for p in params),
             len(prompts.texts), prompts.source)  # fmt: skip
    t0 = time.perf_counter()
    text = PromptConditioning(models, prompts, trainable=method.trains_text_encoder, rank=info.rank, world=world)
    latents = LatentTable.build(cfg, models, inputs.images, info.rank, info.local_rank, world)
    log.info("prepared %d latent inputs and %d prompts in %.1f s", latents.count, len(prompts.texts),
             time.perf_counter() - t0)  # fmt: skip
    if cfg.latent_cache and not cfg.validation_prompt:  # nothing decodes or encodes from here on
        models.vae = None
        gc.collect()
    plan = SamplingPlan(
        seed=seed, num_images=len(inputs.images), num_templates=prompts.num_templates,
        num_timesteps=models.noise_scheduler.config.num_train_timesteps, latent_shape=latents.shape,
    )  # fmt: skip
    unet = models.unet
    module = method.ddp_module()
    if module is not None and world > 1:
        from torch.nn.parallel import DistributedDataParallel

        with collective("DistributedDataParallel set-up"):
            unet = DistributedDataParallel(module, broadcast_buffers=False, gradient_as_bucket_view=True)
    return Job(cfg, info, backend, models, method, prompts, text, latents, plan, unet, optimizer, lr_scheduler, seed,
               start_step, base_model, timeouts,
               CollectiveTimeout(world, timeouts.setup_s, _lost_peer_exit(info, status)), status)  # fmt: skip


def _lost_peer_exit(info: RankInfo, status: RankStatusFile):
    """What the collective watchdog does when a collective waits past its limit: report it as any lost peer is
    reported (the log line, and the status file with kind ``timeout``), ask the launcher to end the job, and
    leave (the blocked collective never returns)."""

    def expire(message: str) -> None:
        status.fail("timeout", message)
        print(f"xeonsd train: error: rank {info.rank}/{info.world_size} on {node_address()}: {message}",
              file=sys.stderr, flush=True)  # fmt: skip
        take_the_job_down(info, 2, grace_s=ABORT_GRACE_S)
        os._exit(2)

    return expire


def step_loss(job: Job, examples, clock: RankClock | None = None) -> torch.Tensor:
    """The denoising loss of this rank's examples (mean over them); ``clock`` times the latent lookup as data."""
    models = job.models
    with clock.phase("data") if clock else contextlib.nullcontext():
        latents = job.latents.sample(examples)
        noise = torch.stack([e.noise for e in examples])
    timesteps = torch.tensor([e.timestep for e in examples], dtype=torch.long)
    noisy = models.noise_scheduler.add_noise(latents, noise, timesteps)
    hidden = job.text.hidden([job.prompts.row(e) for e in examples])
    dtype = models.unet_dtype
    model_in = noisy.to(dtype)
    if job.cfg.channels_last:
        model_in = model_in.contiguous(memory_format=torch.channels_last)
    with autocast(models.weight_dtype) if models.unet_autocast else contextlib.nullcontext():
        pred = job.unet(model_in, timesteps, hidden.to(dtype), return_dict=False)[0]
    prediction_type = models.noise_scheduler.config.prediction_type
    if prediction_type == "epsilon":
        target = noise
    elif prediction_type == "v_prediction":
        target = models.noise_scheduler.get_velocity(latents, noise, timesteps)
    else:
        raise ConfigError(f"unsupported prediction type {prediction_type!r} in the model's scheduler")
    return F.mse_loss(pred.float(), target.float(), reduction="mean")


def sync_gradients(job: Job, loss_sum: float) -> float:
    """Average the gradients (unless DistributedDataParallel already did) and the loss over the ranks, in one
    all-reduce; returns the mean loss."""
    if job.ddp:
        packed = torch.tensor([loss_sum])
        all_reduce_mean_(packed, job.world)
        return float(packed[0])
    params = job.method.parameters()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if job.world == 1:  # nothing to average; packing would briefly hold every gradient twice (+3.4 GB for a full UNet)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        return loss_sum
    packed = torch.cat([*(g.reshape(-1).float() for g in grads), torch.tensor([loss_sum])])
    all_reduce_mean_(packed, job.world)
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = packed[offset : offset + n].view_as(g).to(g.dtype)
        offset += n
    return float(packed[-1])


def checkpoint(job: Job, step: int) -> None:
    state = {
        "method": job.cfg.method, "base_model": job.base_model, "step": step, "seed": job.seed,
        "method_state": job.method.state(), "optimizer": job.optimizer.state_dict(),
        "lr_scheduler": job.lr_scheduler.state_dict(), "global_batch": job.global_batch, "config": asdict(job.cfg),
    }  # fmt: skip
    ckpt.save_checkpoint(job.cfg.output_path, step, state, keep=job.cfg.checkpoints_total_limit)


def train_step(job: Job, step: int, step_times: list[float], setup_s: float, clock: RankClock) -> float:
    """One optimizer step: this rank's micro-batches forward and backward, the gradient all-reduce, the update;
    ``clock`` times the data and the all-reduce. Returns the loss averaged over all ranks."""
    cfg = job.cfg
    accumulation = cfg.gradient_accumulation_steps
    loss_sum = 0.0
    for micro in range(accumulation):
        with clock.phase("data"):
            examples = job.plan.batch(step, micro, accumulation, job.world, job.info.rank, cfg.train_batch_size)
        last = micro == accumulation - 1
        if job.ddp and not last:
            with job.unet.no_sync():
                loss = step_loss(job, examples, clock) / accumulation
                loss.backward()
        elif job.ddp:  # the buckets are all-reduced during this backward: watched, with time for it
            loss = step_loss(job, examples, clock) / accumulation
            margin = 2 * max(step_times) if step_times else setup_s
            with job.timeout.watch("all-reduce of the gradient buckets", extra_s=margin):
                loss.backward()
        else:
            loss = step_loss(job, examples, clock) / accumulation
            loss.backward()
        loss_sum += float(loss.detach())
    with job.timeout.watch("all-reduce"), clock.phase("allreduce"):
        mean_loss = sync_gradients(job, loss_sum)
    if job.method.max_grad_norm:
        torch.nn.utils.clip_grad_norm_(job.method.parameters(), job.method.max_grad_norm)
    job.optimizer.step()
    job.lr_scheduler.step()
    job.optimizer.zero_grad(set_to_none=True)
    return mean_loss


def _comm_profiler():
    """A profiler that records the step's collectives (``--count_flops`` on 2+ ranks: the bytes all-reduced are
    measured on the second step, not computed)."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], record_shapes=True)


class RankStats:
    """This rank's clock, and on rank 0 the gathered summary waiting for the next metrics row."""

    def __init__(self, job: Job) -> None:
        self.world = job.world
        self.clock = RankClock(torch.get_num_threads())
        address = node_address()
        self.nodes = all_gather_strings(node_names().get(address, address), job.world)
        self.watch = StragglerWatch(job.cfg.straggler_cpu_util, job.cfg.straggler_ratio)
        self.pending: dict = {}

    def gather(self, is_main: bool) -> None:
        """Every rank takes part: one all-gather of each rank's interval sums."""
        intervals = [Interval.from_floats(v) for v in all_gather_floats(self.clock.take().as_floats(), self.world)]
        if is_main:
            summary = summarize(intervals, self.nodes)
            stragglers = self.watch.judge(summary)
            for s in stragglers:
                log.warning("straggler: %s (ranks %s): %s", s["node"], s["ranks"], "; ".join(s["why"]))
            w = self.watch
            thresholds = {"cpu_util": w.min_util, "compute_ratio": w.ratio, "intervals": w.intervals}
            self.pending = {"rank_stats": {**summary, "thresholds": thresholds}, "stragglers": stragglers}

    def take_row(self) -> dict:
        row, self.pending = self.pending, {}
        return row


def fit(job: Job) -> list[float]:
    """The optimizer steps from ``job.start_step`` on; returns each step's seconds."""
    cfg, info, out = job.cfg, job.info, job.cfg.output_path
    accumulation = cfg.gradient_accumulation_steps
    metrics = MetricsLog(out, resume_step=job.start_step) if info.is_main else None
    job.metrics = metrics
    if cfg.count_flops:
        count_attention()
    progress = None
    if info.is_main:
        from tqdm.auto import tqdm

        # A bar on a terminal; under mpirun (a pipe) progress goes to the log as whole lines instead, since a bar's
        # carriage returns glue other ranks' lines onto it in the job log.
        progress = tqdm(total=cfg.max_train_steps, initial=job.start_step, desc=cfg.method.replace("_", " "),
                        dynamic_ncols=True, mininterval=0.5, disable=not sys.stderr.isatty())  # fmt: skip
    log_progress_every = max(1, cfg.max_train_steps // 20)
    step_times: list[float] = []
    timeouts = job.timeouts
    stats = RankStats(job)
    clock = stats.clock
    with job.timeout.watch("barrier"):
        barrier(job.world)  # every rank is set up: from here on a collective that waits past the step timeout fails
    job.status.update(state="running", step=job.start_step)
    with job.timeout.scope(timeouts.step_s):
        if job.world > 1 and timeouts.step_s is not None:
            log.info("collective timeout during the steps: %.0f s (set-up: %.0f s)", timeouts.step_s, timeouts.setup_s)
        for step in range(job.start_step, cfg.max_train_steps):
            t_step = time.perf_counter()
            clock.start_step()
            flop_counter = FlopCounterMode(display=False) if cfg.count_flops and step == job.start_step else None
            comm = _comm_profiler() if cfg.count_flops and job.world > 1 and step == job.start_step + 1 else None
            with flop_counter or contextlib.nullcontext(), comm or contextlib.nullcontext():
                mean_loss = train_step(job, step, step_times, timeouts.setup_s, clock)
            done = step + 1
            job.method.after_step(done)
            dt = time.perf_counter() - t_step
            clock.end_step()
            step_times.append(dt)
            job.status.update(step=done)
            if done % cfg.stats_every == 0 or done == cfg.max_train_steps:
                with job.timeout.watch("all-gather of the ranks' statistics"):
                    stats.gather(info.is_main)
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{mean_loss:.4f}", s_per_step=f"{dt:.2f}")
                if progress.disable and (done % log_progress_every == 0 or done == cfg.max_train_steps):
                    log.info("step %d/%d loss %.4f %.2f s/step", done, cfg.max_train_steps, mean_loss, dt)
            if metrics is not None and (done % cfg.log_every == 0 or done == cfg.max_train_steps):
                metrics.append({
                    "step": done, "loss": mean_loss, "lr": job.lr_scheduler.get_last_lr()[0], "s_per_step": dt,
                    "images_per_s": job.global_batch * accumulation / dt, "ranks": job.world,
                    "backend": job.backend or "none", "method": cfg.method, "allreduce_bytes": job.allreduce_bytes(),
                    "time": time.time(),
                    **({"tflop_per_rank": flop_counter.get_total_flops() / 1e12} if flop_counter else {}),
                    **({"allreduce_bytes_measured": allreduced_elements(comm) * 4} if comm else {}),
                    **stats.take_row(),
                })  # fmt: skip
            if info.is_main:
                job.method.periodic_save(out, done)
                # The last step is checkpointed too: a crash while the result is saved loses nothing.
                if cfg.checkpointing_steps and (done % cfg.checkpointing_steps == 0 or done == cfg.max_train_steps):
                    checkpoint(job, done)
            if cfg.validation_prompt and cfg.validation_steps and done % cfg.validation_steps == 0:
                # Rank 0 renders images for minutes on a CPU while the others wait: the set-up timeout applies.
                with job.timeout.scope(timeouts.setup_s):
                    if info.is_main:
                        render_validation(cfg, job.models, out / "validation" / f"step-{done}", job.seed)
                    with job.timeout.watch("barrier after the validation images"):
                        barrier(job.world)
    if progress is not None:
        progress.close()
    return step_times


def save(job: Job, step_times: list[float]) -> dict:
    """Rank 0 writes the method's result, the metrics and the loss plot while the others wait."""
    cfg, out, world = job.cfg, job.cfg.output_path, job.world
    job.status.update(state="saving")
    summary = {
        "steps": cfg.max_train_steps, "ranks": world, "backend": job.backend or "none", "seed": job.seed,
        "median_s_per_step": sorted(step_times)[len(step_times) // 2] if step_times else None,
        "output_dir": str(out), **job.method.summary(),
    }  # fmt: skip
    if job.info.is_main:
        if cfg.validation_prompt:
            render_validation(cfg, job.models, out / "validation" / "final", job.seed)
        job.method.save(out)
        metrics = job.metrics
        assert metrics is not None
        if metrics.rows:
            what = cfg.placeholder_token if cfg.method == "textual_inversion" else cfg.method
            plot_loss(metrics.rows, out / "loss.png", title=f"{what}: {world} rank(s)")
        metrics.finish()
        write_summary(out, train_summary(
            job.method.summary(), base_model=cfg.pretrained_model_name_or_path, base_model_fingerprint=job.base_model,
            steps=cfg.max_train_steps, ranks=world, allreduce_bytes_per_step=job.allreduce_bytes(),
            prompts={"source": job.prompts.source, "count": len(job.prompts.texts), "per_image": job.prompts.per_image},
            result_path=job.method.outputs[0], result_bytes=result_bytes(out, job.method.outputs[0]),
        ))  # fmt: skip
        log.info("saved the %s result to %s", cfg.method, out)
    with job.timeout.watch("barrier after saving"):
        barrier(world)
    job.timeout.close()
    return summary


def main(argv: list[str]) -> int:
    info = detect_ranks()
    status: RankStatusFile | None = None
    try:
        cfg = parse_config(argv)
        status = None if cfg.dry_run else start_status(cfg, info)
        summary = run(cfg, status)
    except BAD_INPUT as exc:
        if status is not None:  # the status file first: the play reads it, the log line is for people
            if isinstance(exc, PeerLostError):
                status.fail("lost_peer", str(exc), exc.peer)
            else:
                status.fail("input", str(exc))
        where = f"rank {info.rank}/{info.world_size} on {node_address()}: " if info.world_size > 1 else ""
        print(f"xeonsd train: error: {where}{exc}", file=sys.stderr)
        take_the_job_down(info, 2, grace_s=ABORT_GRACE_S if isinstance(exc, PeerLostError) else 0.0)
        return 2
    except Exception as exc:
        if status is not None:
            status.fail("exception", f"{type(exc).__name__}: {exc}")
        if info.world_size > 1:
            print(
                f"xeonsd train: error: rank {info.rank}/{info.world_size} on {node_address()} failed:", file=sys.stderr
            )
            traceback.print_exc()
            take_the_job_down(info, 1)
        raise
    if summary.get("dry_run"):
        return 0
    assert status is not None
    status.update(state="done")
    if info.is_main:
        med = summary["median_s_per_step"]
        print(f"done: {summary['steps']} steps on {summary['ranks']} rank(s), backend {summary['backend']}, "
              f"median {med:.3f} s/step; outputs in {summary['output_dir']}" if med is not None else
              f"done: nothing to do (already at step {summary['steps']}); outputs in {summary['output_dir']}")  # fmt: skip
    return 0
