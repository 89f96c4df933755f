"""``xeonsd train``: textual inversion on CPUs, data-parallel over MPI ranks.

setup (ranks, cores, models) → data (latent cache) → step (UNet in bf16, only the concept's vectors learn)
→ log → checkpoint → save. Rank 0 writes every file; every rank logs with its rank in the prefix.
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
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from xeonsd import checkpoint as ckpt
from xeonsd.config import TrainConfig, parse_config
from xeonsd.cpu import cpu_info
from xeonsd.data import DataError, SamplingPlan, find_images, load_all_pixels, templates_for
from xeonsd.distributed import (
    DistributedError,
    PeerLostError,
    RankInfo,
    Timeouts,
    all_reduce_mean_,
    barrier,
    collective,
    destroy_process_group,
    detect_ranks,
    init_process_group,
    node_address,
    place_rank,
    set_collective_timeout,
    take_the_job_down,
)
from xeonsd.embeddings import ConceptError, PlaceholderEmbedding, add_concept, save_learned_embeds
from xeonsd.latents import build_latent_cache, encode_distribution, sample_latents
from xeonsd.metrics import MetricsLog, plot_loss
from xeonsd.models import ConfigError, autocast, load_models, render_validation, save_full_pipeline
from xeonsd.modelsource import ModelSourceError, check_model_source

log = logging.getLogger("xeonsd.train")
# A rank that lost a peer waits this long before ending the job, so that the other survivors report it too.
ABORT_GRACE_S = 3.0

EMBEDS_FILE = "learned_embeds.safetensors"


def validate(cfg: TrainConfig, info: RankInfo) -> tuple[list[Path], Path | None]:
    """Check everything that can be checked cheaply; returns the training images (each checked to decode) and
    the checkpoint to resume from, if any."""
    if cfg.mixed_precision == "fp16":
        raise ConfigError(
            "--mixed_precision fp16 is not supported on CPU (no fp16 autocast/AMX path for training); "
            "use --mixed_precision bf16 (AMX) or no"
        )
    if cfg.resolution <= 0 or cfg.resolution % 8:
        raise ConfigError(
            f"--resolution must be a positive multiple of 8 (the VAE downsamples by 8), got {cfg.resolution}"
        )
    for name in ("train_batch_size", "gradient_accumulation_steps", "max_train_steps", "num_vectors"):
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
    check_model_source(cfg.pretrained_model_name_or_path, revision=cfg.revision)
    earlier = [n for n in (EMBEDS_FILE, "metrics.jsonl", "metrics.partial.jsonl") if (cfg.output_path / n).exists()]
    earlier += [p.name for _, p in ckpt.list_checkpoints(cfg.output_path)]
    if info.is_main and earlier and not cfg.resume_from_checkpoint and not cfg.overwrite_output_dir:
        raise ConfigError(
            f"--output_dir {cfg.output_dir} already holds a run ({', '.join(sorted(earlier)[:4])}); continue it with "
            "--resume_from_checkpoint latest, replace it with --overwrite_output_dir, or choose another --output_dir"
        )
    resume = None
    # Checkpoints live in rank 0's output dir (on the primary node); rank 0 reads and broadcasts the state.
    if cfg.resume_from_checkpoint and info.is_main:
        resume = ckpt.resolve_resume(cfg.resume_from_checkpoint, cfg.output_path)
    return images, resume


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
        for name in ("diffusers", "transformers"):
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


def run(cfg: TrainConfig) -> dict:
    """Train; returns a summary dict. Raises ConfigError/DataError/ConceptError/CheckpointError on bad input."""
    info = detect_ranks()
    _setup_logging(info)
    images, resume_path = validate(cfg, info)
    timeouts = Timeouts.from_env()
    if cfg.mixed_precision == "auto":
        cfg = dataclasses.replace(cfg, mixed_precision="bf16" if cpu_info().native_bf16 else "no")
    placement = place_rank(info)
    backend = init_process_group(info)
    try:
        return _train(cfg, info, placement.threads, placement.cpus, backend, images, resume_path, timeouts)
    finally:
        destroy_process_group()


def _train(cfg, info: RankInfo, threads: int, cpus, backend, images: list[Path], resume_path, timeouts) -> dict:  # noqa: C901 - one readable loop
    out = cfg.output_path
    world = info.world_size
    # ---- setup -------------------------------------------------------------------------------------------------
    models = load_models(cfg)
    tokenizer, text_encoder, vae, unet = models.tokenizer, models.text_encoder, models.vae, models.unet
    log.info(
        "node=%s pid=%d launcher=%s backend=%s threads=%d cores=%s dtype=%s bf16_hw=%s ipex=%s local_rank=%d/%d",
        node_address(), os.getpid(), info.launcher, backend or "none (single process)", threads, ",".join(map(str, cpus)),
        str(models.weight_dtype).replace("torch.", ""), cpu_info().native_bf16 or "none",
        "on" if models.ipex else "off",
        info.local_rank, info.local_world_size,
    )  # fmt: skip
    native = cpu_info().native_bf16
    if models.weight_dtype == torch.bfloat16 and native is None:
        log.warning(
            "--mixed_precision bf16 on a CPU without AMX or AVX512-BF16 (%s): bf16 matmuls are emulated and far "
            "slower than fp32 here; use --mixed_precision no on this machine",
            cpu_info().model,
        )
    concept = add_concept(tokenizer, text_encoder, cfg.placeholder_token, cfg.initializer_token, cfg.num_vectors)
    base_embedding = text_encoder.get_input_embeddings()
    if cfg.train_full_embedding_matrix:
        trainable = base_embedding.weight
        trainable.requires_grad_(True)
        frozen_rows = base_embedding.weight.detach().clone()
        keep_mask = torch.ones(trainable.shape[0], dtype=torch.bool)
        keep_mask[concept.ids] = False
    else:
        placeholder_module = PlaceholderEmbedding(base_embedding, concept.ids[0], cfg.num_vectors)
        text_encoder.set_input_embeddings(placeholder_module)
        trainable = placeholder_module.vectors

    resume_state = _shared_resume_state(resume_path, world)
    seed = _shared_seed(cfg, info, resume_state)
    global_batch = world * cfg.train_batch_size
    lr = cfg.learning_rate
    if cfg.scale_lr:
        lr = lr * cfg.gradient_accumulation_steps * cfg.train_batch_size * world
    optimizer = torch.optim.AdamW(
        [trainable], lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
        weight_decay=cfg.adam_weight_decay, eps=cfg.adam_epsilon,
    )  # fmt: skip
    from diffusers.optimization import get_scheduler

    lr_scheduler = get_scheduler(
        cfg.lr_scheduler, optimizer=optimizer,
        num_warmup_steps=cfg.lr_warmup_steps, num_training_steps=cfg.max_train_steps,
    )  # fmt: skip
    start_step = 0
    if resume_state is not None:
        state = resume_state
        if state["placeholder_tokens"] != concept.tokens:
            raise ckpt.CheckpointError(
                f"checkpoint {resume_path} was trained for {state['placeholder_tokens']}, not {concept.tokens}"
            )
        with torch.no_grad():
            if cfg.train_full_embedding_matrix:
                trainable[concept.ids] = state["vectors"].to(trainable.dtype)
            else:
                trainable.copy_(state["vectors"])
        optimizer.load_state_dict(state["optimizer"])
        lr_scheduler.load_state_dict(state["lr_scheduler"])
        start_step = int(state["step"])
        if state.get("global_batch") != global_batch:
            log.warning("resuming with global batch %d (checkpoint used %s)", global_batch, state.get("global_batch"))
        log.info("resumed from %s at step %d", resume_path, start_step)

    # ---- data --------------------------------------------------------------------------------------------------
    pixels = load_all_pixels(images, cfg.resolution, cfg.center_crop, cfg.dataloader_num_workers)
    vae_scale = 2 ** (len(vae.config.block_out_channels) - 1)
    latent_shape = (vae.config.latent_channels, cfg.resolution // vae_scale, cfg.resolution // vae_scale)
    scaling = vae.config.scaling_factor
    templates = templates_for(cfg.learnable_property)
    prompt_ids = tokenizer(
        [t.format(concept.prompt_text) for t in templates],
        padding="max_length", truncation=True, max_length=tokenizer.model_max_length, return_tensors="pt",
    ).input_ids  # fmt: skip
    plan = SamplingPlan(
        seed=seed, num_images=len(images), num_templates=len(templates),
        num_timesteps=models.noise_scheduler.config.num_train_timesteps, latent_shape=latent_shape,
    )  # fmt: skip
    t0 = time.perf_counter()
    if cfg.latent_cache:
        lat_mean, lat_std = build_latent_cache(vae, pixels, models.weight_dtype, latent_shape, info.rank, world)
        log.info("cached latents of %d inputs in %.1f s", pixels.shape[0], time.perf_counter() - t0)
        if not cfg.validation_prompt:  # nothing decodes or encodes from here on: give the VAE's memory back
            models.vae = vae = None
            gc.collect()
    prediction_type = models.noise_scheduler.config.prediction_type

    def step_loss(examples) -> torch.Tensor:
        ids = torch.stack([prompt_ids[e.template] for e in examples])
        eps = torch.stack([e.latent_eps for e in examples])
        rows = [e.input_id for e in examples]
        if cfg.latent_cache:
            mean, std = lat_mean[rows], lat_std[rows]
        else:
            mean, std = encode_distribution(vae, pixels[rows], models.weight_dtype)
        latents = sample_latents(mean, std, eps, scaling)
        noise = torch.stack([e.noise for e in examples])
        timesteps = torch.tensor([e.timestep for e in examples], dtype=torch.long)
        noisy = models.noise_scheduler.add_noise(latents, noise, timesteps)
        with autocast(models.weight_dtype):
            hidden = text_encoder(ids)[0]
        model_in = noisy.to(models.weight_dtype)
        if cfg.channels_last:
            model_in = model_in.contiguous(memory_format=torch.channels_last)
        pred = unet(model_in, timesteps, hidden.to(models.weight_dtype)).sample
        if prediction_type == "epsilon":
            target = noise
        elif prediction_type == "v_prediction":
            target = models.noise_scheduler.get_velocity(latents, noise, timesteps)
        else:
            raise ConfigError(f"unsupported prediction type {prediction_type!r} in the model's scheduler")
        return F.mse_loss(pred.float(), target.float(), reduction="mean")

    # ---- loop --------------------------------------------------------------------------------------------------
    metrics = MetricsLog(out, resume_step=start_step) if info.is_main else None
    allreduce_numel = trainable.numel() + 1
    progress = None
    if info.is_main:
        from tqdm.auto import tqdm

        # A bar on a terminal; under mpirun (a pipe) progress goes to the log as whole lines instead, since a bar's
        # carriage returns glue other ranks' lines onto it in the job log.
        progress = tqdm(total=cfg.max_train_steps, initial=start_step, desc="textual inversion", dynamic_ncols=True,
                        mininterval=0.5, disable=not sys.stderr.isatty())  # fmt: skip
    log_progress_every = max(1, cfg.max_train_steps // 20)
    step_times: list[float] = []
    # Every rank is set up: from here on a collective that waits longer than the step timeout ends the job.
    barrier(world)
    set_collective_timeout(timeouts.step_s, world)
    if world > 1 and timeouts.step_s is not None:
        log.info("collective timeout during the steps: %.0f s (set-up: %.0f s)", timeouts.step_s, timeouts.setup_s)
    for step in range(start_step, cfg.max_train_steps):
        t_step = time.perf_counter()
        loss_sum = 0.0
        flop_counter = FlopCounterMode(display=False) if cfg.count_flops and step == start_step else None
        with flop_counter or contextlib.nullcontext():
            for micro in range(cfg.gradient_accumulation_steps):
                examples = plan.batch(
                    step, micro, cfg.gradient_accumulation_steps, world, info.rank, cfg.train_batch_size
                )
                loss = step_loss(examples) / cfg.gradient_accumulation_steps
                loss.backward()
                loss_sum += float(loss.detach())
        # One all-reduce per step carries the gradient and the loss: num_vectors x hidden + 1 floats.
        grad = trainable.grad
        packed = torch.cat([grad.reshape(-1).float(), torch.tensor([loss_sum])])
        all_reduce_mean_(packed, world)
        grad.copy_(packed[:-1].view_as(grad))
        mean_loss = float(packed[-1])
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if cfg.train_full_embedding_matrix:
            with torch.no_grad():  # the recipe's way: undo the update on every row but the placeholders
                trainable[keep_mask] = frozen_rows[keep_mask]
        dt = time.perf_counter() - t_step
        step_times.append(dt)
        done = step + 1
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{mean_loss:.4f}", s_per_step=f"{dt:.2f}")
            if progress.disable and (done % log_progress_every == 0 or done == cfg.max_train_steps):
                log.info("step %d/%d loss %.4f %.2f s/step", done, cfg.max_train_steps, mean_loss, dt)
        if metrics is not None and (done % cfg.log_every == 0 or done == cfg.max_train_steps):
            metrics.append({
                "step": done, "loss": mean_loss, "lr": lr_scheduler.get_last_lr()[0], "s_per_step": dt,
                "images_per_s": global_batch * cfg.gradient_accumulation_steps / dt, "ranks": world,
                "backend": backend or "none", "allreduce_bytes": allreduce_numel * 4, "time": time.time(),
                **({"tflop_per_rank": flop_counter.get_total_flops() / 1e12} if flop_counter else {}),
            })  # fmt: skip
        vectors = trainable[concept.ids] if cfg.train_full_embedding_matrix else trainable
        if info.is_main and cfg.save_steps and done % cfg.save_steps == 0:
            save_learned_embeds(out / f"learned_embeds-steps-{done}.safetensors", cfg.placeholder_token, vectors)
        if (
            info.is_main
            and cfg.checkpointing_steps
            and done % cfg.checkpointing_steps == 0
            and done < cfg.max_train_steps
        ):
            ckpt.save_checkpoint(out, done, {
                "step": done, "seed": seed, "vectors": vectors.detach().clone(), "placeholder_tokens": concept.tokens,
                "optimizer": optimizer.state_dict(), "lr_scheduler": lr_scheduler.state_dict(),
                "global_batch": global_batch, "config": asdict(cfg),
            }, keep=cfg.checkpoints_total_limit)  # fmt: skip
        if cfg.validation_prompt and cfg.validation_steps and done % cfg.validation_steps == 0:
            # Rank 0 renders images for minutes on a CPU while the others wait: the set-up timeout applies.
            set_collective_timeout(timeouts.setup_s, world)
            if info.is_main:
                render_validation(cfg, models, out / "validation" / f"step-{done}", seed)
            barrier(world)
            set_collective_timeout(timeouts.step_s, world)
    if progress is not None:
        progress.close()
    set_collective_timeout(timeouts.setup_s, world)  # rank 0 saves the pipeline while the others wait

    # ---- save --------------------------------------------------------------------------------------------------
    vectors = (trainable[concept.ids] if cfg.train_full_embedding_matrix else trainable).detach().clone()
    summary = {
        "steps": cfg.max_train_steps, "ranks": world, "backend": backend or "none", "seed": seed,
        "median_s_per_step": sorted(step_times)[len(step_times) // 2] if step_times else None,
        "output_dir": str(out),
    }  # fmt: skip
    if info.is_main:
        if cfg.save_as_full_pipeline:
            save_full_pipeline(cfg, tokenizer, text_encoder, out)
        if cfg.validation_prompt:
            render_validation(cfg, models, out / "validation" / "final", seed)
        save_learned_embeds(out / EMBEDS_FILE, cfg.placeholder_token, vectors)
        assert metrics is not None
        if metrics.rows:
            plot_loss(metrics.rows, out / "loss.png", title=f"{cfg.placeholder_token}: {world} rank(s)")
        metrics.finish()
        log.info("saved %s to %s", EMBEDS_FILE, out)
    barrier(world)
    return summary


def main(argv: list[str]) -> int:
    cfg = parse_config(argv)
    info = detect_ranks()
    try:
        summary = run(cfg)
    except (ConfigError, ModelSourceError, DataError, ConceptError, ckpt.CheckpointError, DistributedError) as exc:
        where = f"rank {info.rank}/{info.world_size} on {node_address()}: " if info.world_size > 1 else ""
        print(f"xeonsd train: error: {where}{exc}", file=sys.stderr)
        take_the_job_down(info, 2, grace_s=ABORT_GRACE_S if isinstance(exc, PeerLostError) else 0.0)
        return 2
    except Exception:
        if info.world_size > 1:
            print(
                f"xeonsd train: error: rank {info.rank}/{info.world_size} on {node_address()} failed:", file=sys.stderr
            )
            traceback.print_exc()
            take_the_job_down(info, 1)
        raise
    if info.is_main:
        med = summary["median_s_per_step"]
        print(f"done: {summary['steps']} steps on {summary['ranks']} rank(s), backend {summary['backend']}, "
              f"median {med:.3f} s/step; outputs in {summary['output_dir']}" if med is not None else
              f"done: nothing to do (already at step {summary['steps']}); outputs in {summary['output_dir']}")  # fmt: skip
    return 0
