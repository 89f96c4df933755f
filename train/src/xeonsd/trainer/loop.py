"""``xeonsd train``: fine-tune Stable Diffusion on CPUs, data-parallel over MPI ranks.

One loop for every method (:mod:`xeonsd.trainer.methods`): ``validate`` (:mod:`.inputs`: everything checked before a
model loads) → ``setup`` (:mod:`.job`: ranks, models, the method's trainable part, the latent and prompt caches,
optimizer, resume) → ``fit`` (per step: each rank's share of the global batch, loss, backward, gradient all-reduce,
optimizer; then the observers of :mod:`.after_step.observers`: status, statistics, progress, metrics, checkpoint, validation) →
``save`` (the method's result, metrics, loss plot). Rank 0 writes every file; every rank logs with its rank in the
prefix and keeps its own status file on its node (``status/rank-<r>.json``, :mod:`xeonsd.contracts.job_status`:
state, step, and the kind of error that ended it). A job told to stop (SIGTERM, SIGINT, SIGUSR1) stops at the
same step on every rank with a checkpoint there and exits with 128 + the signal (:mod:`.stopping`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import logging
import sys
import time
import traceback
from dataclasses import dataclass
from typing import TextIO

from xeonsd.cluster.distributed import (
    PeerLostError,
    barrier,
    destroy_process_group,
    init_process_group,
    node_address,
    take_the_job_down,
)
from xeonsd.cluster.launch import DistributedError, RankInfo, Timeouts, detect_ranks
from xeonsd.cluster.placement import place_rank
from xeonsd.cluster.rank_stats import RankClock
from xeonsd.cpu import cpu_info
from xeonsd.jobs.status_file import RankStatusFile
from xeonsd.modelfiles.modelsource import ModelSourceError
from xeonsd.trainer import checkpoint as ckpt
from xeonsd.trainer import sharding
from xeonsd.trainer.after_step import StepEnd
from xeonsd.trainer.after_step.observers import StepObservers
from xeonsd.trainer.argv import parse_config
from xeonsd.trainer.attention import routed_attention
from xeonsd.trainer.config import ConfigError, TrainConfig
from xeonsd.trainer.data import DataError
from xeonsd.trainer.embeddings import ConceptError
from xeonsd.trainer.inputs import check_memory, validate
from xeonsd.trainer.job import ABORT_GRACE_S, Job, setup
from xeonsd.trainer.libraries import skip_unused_packages
from xeonsd.trainer.metrics import MetricsLog, plot_loss, write_summary
from xeonsd.trainer.pipelines import render_validation
from xeonsd.trainer.rank_io import setup_logging, start_status
from xeonsd.trainer.resolution import with_resolution
from xeonsd.trainer.shared_weights import SharedWeightsError, open_for_job
from xeonsd.trainer.step import step_loss, sync_gradients, update
from xeonsd.trainer.stopping import Interrupted, StopSignals
from xeonsd.trainer.summary import train_summary
from xeonsd.trainer.tracking import Tracker
from xeonsd.trainer.validation import write_image_grid

log = logging.getLogger("xeonsd.train")

BAD_INPUT = (
    ConfigError,
    ModelSourceError,
    DataError,
    ConceptError,
    ckpt.CheckpointError,
    DistributedError,
    SharedWeightsError,
)


def run(
    cfg: TrainConfig, status: RankStatusFile | None, signals: StopSignals | None = None, open_renderer=None
) -> dict:
    """Train; returns a summary dict. Raises one of BAD_INPUT on bad input, Interrupted when ``signals`` got a
    stop signal. ``status`` is None only for a dry run (which trains nothing)."""
    started = time.perf_counter()
    info = detect_ranks()
    setup_logging(info)
    inputs = validate(cfg, info)
    skip_unused_packages()  # before the first model import (the memory estimate's): this process only
    cfg = with_resolution(cfg, inputs.family)
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
        with open_for_job(cfg, info.local_world_size) as store:
            job = setup(cfg, info, backend, placement, inputs, timeouts, status, open_renderer, store)
            fitted = fit(job, signals or StopSignals(), started)
            return save(job, fitted)
    finally:
        destroy_process_group()


@dataclass(frozen=True)
class Fitted:
    """What ``fit`` leaves for ``save``: each step's seconds on this rank, and rank 0's metrics."""

    step_times: list[float]
    metrics: MetricsLog | None
    first_step_s: float | None = None  # from the trainer's start to the first step's
    first_step_cpu_s: float | None = None  # this process's CPU seconds (all threads, imports included) until then
    tracker: Tracker | None = None  # rank 0's --report_to curves, closed by save()


def fit(job: Job, signals: StopSignals, started: float | None = None) -> Fitted:
    """The optimizer steps from the job's start step on, each followed by the ranks' agreement on whether to stop
    (``signals``) and the observers of :mod:`.after_step.observers` (status file, rank statistics, progress, metrics row,
    checkpoint, validation images). Raises Interrupted after the step the ranks agreed to stop at. ``started``:
    the trainer's start (``time.perf_counter``), for the time to the first step."""
    cluster = job.cluster
    observers = StepObservers(job)
    step_times: list[float] = []
    with cluster.timeout.watch("barrier"):
        barrier(job.world)  # every rank is set up: from here on a collective that waits past the step timeout fails
    signals.defer()  # from here on a signal stops the job at a step's end, with a checkpoint
    cluster.status.update(state="running", step=job.run.start_step)
    first_step_s = None if started is None else time.perf_counter() - started
    first_step_cpu_s = time.process_time()
    if first_step_s is not None and job.is_main:
        log.info(
            "time to first step: %.1f s (checks, models, latent and prompt caches); %.1f CPU s since the process "
            "started (imports included)",
            first_step_s,
            first_step_cpu_s,
        )
    with cluster.timeout.scope(cluster.timeouts.step_s):
        _log_step_timeout(job)
        for step in range(job.run.start_step, job.run.cfg.max_train_steps):
            t0 = time.perf_counter()
            with observers.around_step(step):  # the rank clock, and --count_flops' counters
                loss = train_step(job, step, observers.clock, _bucket_margin_s(job, step_times))
            step_times.append(time.perf_counter() - t0)
            with cluster.timeout.watch("all-reduce of the stop flag"):
                signum = signals.agree(job.world)
            end = StepEnd(step=step + 1, loss=loss, seconds=step_times[-1], stopping=bool(signum))
            if signum:
                observers.stop(end, signum, signals.timeout_s)  # raises Interrupted
            observers.on_step_end(end)
    observers.close()
    return Fitted(step_times, observers.metrics, first_step_s, first_step_cpu_s, observers.tracker)


def _log_step_timeout(job: Job) -> None:
    timeouts = job.cluster.timeouts
    if job.world > 1 and timeouts.step_s is not None:
        log.info("collective timeout during the steps: %.0f s (set-up: %.0f s)", timeouts.step_s, timeouts.setup_s)


def _bucket_margin_s(job: Job, step_times: list[float]) -> float:
    """The time DistributedDataParallel's bucket all-reduce gets on top of the step timeout (it runs inside the
    backward): twice the slowest step so far, the set-up timeout before the first."""
    return 2 * max(step_times) if step_times else job.cluster.timeouts.setup_s


def train_step(job: Job, step: int, clock: RankClock, bucket_margin_s: float) -> float:
    """One optimizer step: this rank's micro-batches sampled, forward and backward (the attention as --attention
    says: :mod:`.attention`), the gradient all-reduce, the update (:mod:`.step`); ``clock`` times the data and the
    all-reduce. Returns the loss averaged over all ranks."""
    cfg, training = job.run.cfg, job.training
    accumulation = cfg.gradient_accumulation_steps
    inputs = job.loss_inputs()
    loss_sum = 0.0
    for micro in range(accumulation):
        with clock.phase("data"):
            examples = job.data.plan.batch(
                step, micro, accumulation, job.world, job.cluster.info.rank, cfg.train_batch_size
            )
        last = micro == accumulation - 1
        # the backward inside routed_attention too: a checkpointed block's forward runs again there
        with _accumulating(job, last), _sharded_collectives(job, bucket_margin_s), routed_attention(cfg.attention):
            loss = step_loss(inputs, examples, clock) / accumulation
            with _bucket_allreduce(job, last, bucket_margin_s):
                loss.backward()
        loss_sum += float(loss.detach())
    with job.cluster.timeout.watch("all-reduce"), clock.phase("allreduce"):
        synced = job.ddp or job.sharded
        mean_loss = sync_gradients(training.method.parameters(), loss_sum, job.world, synced)
    update(training.method, training.optimizer, training.lr_scheduler, step + 1)
    return mean_loss


def _accumulating(job: Job, last: bool):
    """Under DistributedDataParallel or --fsdp, every micro-batch but the last keeps its gradients on this rank."""
    if job.sharded:
        sharding.gradient_sync(job.training.unet, last)
    return job.training.unet.no_sync() if job.ddp and not last else contextlib.nullcontext()


def _sharded_collectives(job: Job, margin_s: float):
    """--fsdp: the forward and the backward all-gather each block's weights and reduce-scatter its gradients:
    watched as one."""
    if job.sharded:
        return job.cluster.timeout.watch("all-gathers and reduce-scatters of the sharded UNet", extra_s=margin_s)
    return contextlib.nullcontext()


def _bucket_allreduce(job: Job, last: bool, margin_s: float):
    """Under DistributedDataParallel, the last micro-batch's backward all-reduces the gradient buckets: watched."""
    if job.ddp and last:
        return job.cluster.timeout.watch("all-reduce of the gradient buckets", extra_s=margin_s)
    return contextlib.nullcontext()


def save(job: Job, fitted: Fitted) -> dict:
    """Rank 0 writes the method's result, the metrics and the loss plot while the others wait."""
    cfg, method, out, world = job.run.cfg, job.training.method, job.run.cfg.output_path, job.world
    job.cluster.status.update(state="saving")
    times = fitted.step_times
    summary = {
        "steps": cfg.max_train_steps,
        "ranks": world,
        "backend": job.cluster.backend or "none",
        "seed": job.run.seed,
        "median_s_per_step": sorted(times)[len(times) // 2] if times else None,
        "output_dir": str(out),
        **method.summary(),
    }
    final = out / "validation" / "final"
    if job.is_main or job.sharded:  # sharded (--fsdp): rank 0's denoiser calls and its save need every rank's shards
        if cfg.validation_prompt:
            render_validation(cfg, job.training.models, final if job.is_main else None, job.run.seed)
        method.save(out)
    if job.is_main:
        if cfg.validation_prompt:
            write_image_grid(out)
            if fitted.tracker is not None:
                fitted.tracker.log_images(cfg.max_train_steps, final, "validation_final")
        metrics = fitted.metrics
        assert metrics is not None
        if metrics.rows:
            plot_loss(metrics.rows, out / "loss.png", title=f"{method.label()}: {world} rank(s)")
        metrics.finish()
        if fitted.tracker is not None:
            fitted.tracker.close()
        write_summary(out, train_summary(job, fitted.first_step_s, fitted.first_step_cpu_s))
        log.info("saved the %s result to %s", cfg.method, out)
    with job.cluster.timeout.watch("barrier after saving"):
        barrier(world)
    job.cluster.timeout.close()
    return summary


def main(argv: list[str], console: tuple[TextIO, TextIO] | None = None, open_renderer=None) -> int:
    """``xeonsd train ARGV``; ``console``: the (stdout, stderr) for the run's own result and error lines while the
    process's own streams go to a log (``xeonsd train``'s quiet console); None: sys.stdout and sys.stderr.
    ``open_renderer``: --class_export's OpenVINO side (:data:`xeonsd.trainer.prior.ClassRendererOpener`)."""
    out, err = console or (sys.stdout, sys.stderr)
    info = detect_ranks()
    status: RankStatusFile | None = None
    signals = StopSignals()
    # A write to a weight mapped read-only (--share_weights) ends the rank by SIGSEGV: print the Python line that did.
    with contextlib.suppress(AttributeError, ValueError, OSError):  # a stderr without a file descriptor
        faulthandler.enable()
    try:
        signals.install()
        cfg = parse_config(argv)
        status = None if cfg.dry_run else start_status(cfg, info)
        summary = run(cfg, status, signals, open_renderer)
    except Interrupted as stop:
        return stopped(info, status, stop, err)
    except BAD_INPUT as exc:
        signals.defer()  # a signal from here on (mpirun ending the job) must not cut the report short
        if status is not None:  # the status file first: the play reads it, the log line is for people
            if isinstance(exc, PeerLostError):
                status.fail("lost_peer", str(exc), exc.peer)
            else:
                status.fail("input", str(exc))
        where = f"rank {info.rank}/{info.world_size} on {node_address()}: " if info.world_size > 1 else ""
        print(f"xeonsd train: error: {where}{exc}", file=err, flush=True)
        take_the_job_down(info, 2, grace_s=ABORT_GRACE_S if isinstance(exc, PeerLostError) else 0.0)
        return 2
    except Exception as exc:
        signals.defer()
        if status is not None:
            status.fail("exception", f"{type(exc).__name__}: {exc}")
        if info.world_size > 1:
            where = f"rank {info.rank}/{info.world_size} on {node_address()}"
            print(f"xeonsd train: error: {where} failed:", file=err)
            traceback.print_exc(file=err)
            take_the_job_down(info, 1)
        raise
    finally:
        signals.restore()
    if summary.get("dry_run"):
        return 0
    assert status is not None
    status.update(state="done")
    if info.is_main:
        print(_done_line(summary), file=out, flush=True)
    return 0


def stopped(info: RankInfo, status: RankStatusFile | None, stop: Interrupted, err: TextIO | None = None) -> int:
    """A job told to stop: its status file says so, and it exits with 128 + the signal. Before the steps a rank
    may be alone in that (its peers blocked in a collective): it asks the launcher to end the job."""
    if status is not None:
        status.interrupt(stop.stop)
    if info.is_main or stop.stop.step == 0:
        print(f"xeonsd train: {stop}", file=err or sys.stderr, flush=True)
    if stop.stop.step == 0:
        take_the_job_down(info, stop.exit_code, grace_s=ABORT_GRACE_S)
    return stop.exit_code


def _done_line(summary: dict) -> str:
    med = summary["median_s_per_step"]
    if med is None:
        return f"done: nothing to do (already at step {summary['steps']}); outputs in {summary['output_dir']}"
    return (
        f"done: {summary['steps']} steps on {summary['ranks']} rank(s), backend {summary['backend']}, "
        f"median {med:.3f} s/step; outputs in {summary['output_dir']}"
    )
