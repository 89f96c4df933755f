"""What ``fit`` does around the training step, apart from the step itself: the step observers.

Before a step the rank clock starts and ``--count_flops``' counters wrap the first two steps. After it the rank
clock stops and the observers run in the order of :mod:`.after_step`: this rank's status file gets the step; every
``--stats_every`` steps the ranks' statistics are all-gathered (:mod:`xeonsd.cluster.rank_stats`); every
``--validation_steps`` every rank evaluates its share of the validation loss (before the metrics row, which carries
it); rank 0 draws the progress bar (or, under a pipe, logs a progress line), appends a metrics row every
``--log_every`` steps, saves the method's snapshots and a checkpoint every ``--checkpointing_steps``; rank 0
renders the validation images while the others wait at a barrier. After the step the ranks agreed to stop at
(:mod:`.stopping`) the observers run once more within the stop's time bound, rank 0's checkpoint first
(:data:`xeonsd.trainer.after_step.AFTER_STOP`); then every rank records the stop and raises Interrupted.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import NoReturn

import torch
from torch.utils.flop_counter import FlopCounterMode

from xeonsd.cluster.distributed import all_gather_floats, all_gather_strings, barrier, node_address
from xeonsd.cluster.memory import RankMemory
from xeonsd.cluster.rank_stats import Interval, RankClock, StragglerWatch, node_names, summarize
from xeonsd.flops import allreduced_elements, count_cpu_ops
from xeonsd.step_profile import flops_by_class, seconds_by_class
from xeonsd.trainer import checkpoint as ckpt
from xeonsd.trainer.after_step import StepEnd, StepEndSequence, StepObserver
from xeonsd.trainer.job import Job
from xeonsd.trainer.metrics import MetricsLog
from xeonsd.trainer.pipelines import render_validation
from xeonsd.trainer.stopping import Interrupted, StopDeadline, describe, exit_code, make_stop
from xeonsd.trainer.tracking import Tracker, open_tracker
from xeonsd.trainer.validation import validation_loss

log = logging.getLogger("xeonsd.train")  # the trainer's log lines keep one logger name


class StepObservers:
    """Everything ``fit`` does around the steps, in the order it does it (see the module's docstring)."""

    def __init__(self, job: Job) -> None:
        cfg = job.run.cfg
        self.job = job
        self.metrics = MetricsLog(cfg.output_path, resume_step=job.run.start_step) if job.is_main else None
        # --report_to's curves, rank 0 (its metrics rows and validation images); save() closes it after the last
        self.tracker = open_tracker(cfg, job.run.start_step, self.metrics.rows) if self.metrics is not None else None
        self.counters = StepCounters(job)
        self.progress = Progress(job) if job.is_main else None
        self.stats = RankStats(job)  # every rank: an all-gather of the node names
        self.clock = self.stats.clock
        observers: dict[str, StepObserver] = {"status": StatusUpdates(job), "stats": self.stats}
        extras = [self.counters.row, self.stats.take_row]
        self.validation = ValidationLoss(job) if job.data.validation is not None else None
        if self.validation is not None:  # every rank: each evaluates its share
            observers["validation_loss"] = self.validation
            extras.append(self.validation.take_row)
        if self.progress is not None and self.metrics is not None:  # rank 0
            observers["progress"] = self.progress
            observers["metrics"] = MetricsRows(job, self.metrics, extras, self.validation, self.tracker)
        if job.is_main or job.sharded:  # sharded (--fsdp): every rank sends its shards, rank 0 writes
            observers["checkpoint"] = Checkpoints(job)
        if cfg.validation_prompt and cfg.validation_steps:
            observers["validation_images"] = ValidationImages(job, self.tracker)
        self.sequence = StepEndSequence(observers)  # the order: xeonsd.trainer.after_step

    @contextlib.contextmanager
    def around_step(self, step: int) -> Iterator[None]:
        """The rank clock starts; ``--count_flops``' counters watch the step."""
        self.clock.start_step()
        with self.counters.around(step):
            yield

    def on_step_end(self, end: StepEnd) -> None:
        self.clock.end_step()
        self.sequence.run(end)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()

    def stop(self, end: StepEnd, signum: int, timeout_s: float) -> NoReturn:
        """The ranks agreed to stop after ``end``: within ``timeout_s`` (else the rank exits without it) the
        observers run (rank 0's checkpoint among them), every rank waits for rank 0 and records the stop; then
        raises Interrupted."""
        job, t0 = self.job, time.perf_counter()
        status = job.cluster.status
        with (
            StopDeadline(timeout_s, exit_code(signum), lambda: status.interrupt(make_stop(signum, end.step))),
            job.cluster.timeout.scope(timeout_s),
        ):
            self.on_step_end(end)
            with job.cluster.timeout.watch("barrier after the stop's checkpoint"):
                barrier(job.world)
            stop = make_stop(signum, end.step, ckpt.checkpoint_name(end.step))
            status.interrupt(stop)
        self.close()
        if self.tracker is not None:  # no save follows a stop: it would have closed the tracker
            self.tracker.close()
        if job.is_main:
            log.warning("%s: %s written in %.1f s", describe(signum), stop.checkpoint, time.perf_counter() - t0)
        raise Interrupted(signum, stop)


class StepCounters:
    """``--count_flops``: the first step's FLOPs are counted and, on 2+ ranks, the second step's collectives
    recorded (the bytes all-reduced are measured, not computed). ``--profile_step N``: step N is recorded by
    ``torch.profiler`` and its time split per class of work (:mod:`xeonsd.step_profile`), and the first step's
    FLOPs are split the same way."""

    def __init__(self, job: Job) -> None:
        self.enabled = job.run.cfg.count_flops
        self.profile_step = job.run.cfg.profile_step
        self.first = job.run.start_step
        self.world = job.world
        self.flops: FlopCounterMode | None = None
        self.comm = None
        self.prof = None
        self.prof_wall_s = 0.0
        if self.enabled:
            count_cpu_ops()

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[None]:
        self.flops = FlopCounterMode(display=False) if self.enabled and step == self.first else None
        self.comm = _profiler(shapes=True) if self.enabled and self.world > 1 and step == self.first + 1 else None
        self.prof = _profiler() if step + 1 == self.profile_step and self.comm is None else None
        t0 = time.perf_counter()
        with (
            self.flops or contextlib.nullcontext(),
            self.comm or contextlib.nullcontext(),
            self.prof or contextlib.nullcontext(),
        ):
            yield
        self.prof_wall_s = time.perf_counter() - t0

    def row(self) -> dict:
        """The last step's counts, for its metrics row."""
        row = {}
        if self.flops:
            row["tflop_per_rank"] = self.flops.get_total_flops() / 1e12
            if self.profile_step:
                by_class = flops_by_class(self.flops.get_flop_counts().get("Global", {}))
                row["tflop_by_class"] = {k: v / 1e12 for k, v in by_class.items()}
        if self.comm:
            row["allreduce_bytes_measured"] = allreduced_elements(self.comm) * 4
        if self.prof:
            seconds = seconds_by_class(self.prof.events(), self.prof_wall_s)
            row["step_profile"] = {"wall_s": self.prof_wall_s, "seconds_by_class": seconds}
        return row


def _profiler(shapes: bool = False):
    """A profiler of one step's CPU ops; ``shapes``: with their inputs' shapes (what the collectives moved), else no
    shapes and no stacks (as little overhead as it can have)."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], record_shapes=shapes)


class StatusUpdates:
    """This rank's status file: the steps done."""

    def __init__(self, job: Job) -> None:
        self.status = job.cluster.status

    def on_step_end(self, end: StepEnd) -> None:
        self.status.update(step=end.step)


class RankStats:
    """This rank's clock, the all-gather of every rank's interval sums every ``--stats_every`` steps, and on rank
    0 the gathered summary (stragglers logged) waiting for the next metrics row."""

    def __init__(self, job: Job) -> None:
        self.world = job.world
        self.is_main = job.is_main
        self.every = job.run.cfg.stats_every
        self.last = job.run.cfg.max_train_steps
        self.timeout = job.cluster.timeout
        self.clock = RankClock(torch.get_num_threads())
        address = node_address()
        self.nodes = all_gather_strings(node_names().get(address, address), job.world)
        self.watch = StragglerWatch(job.run.cfg.straggler_cpu_util, job.run.cfg.straggler_ratio)
        self.layout_logged = False
        self.memory, self.status = RankMemory(job.cluster.info.rank), job.cluster.status
        loaded = self.memory_rows("after loading")  # the models are loaded by now
        self.pending: dict = {"memory_loaded": loaded} if loaded else {}

    def memory_rows(self, when: str) -> dict:
        """Every rank: its memory figures into its status file; the node totals (xeonsd.cluster.memory)."""
        rows = self.memory.measure(self.world, self.nodes, when, self.status.record_memory)
        return {"nodes": rows} if rows else {}

    def on_step_end(self, end: StepEnd) -> None:
        if end.step % self.every == 0 or end.step == self.last or end.stopping:
            with self.timeout.watch("all-gather of the ranks' statistics"):
                self.gather()
                memory = self.memory_rows(f"at step {end.step}")
            if self.is_main and memory:
                self.pending["memory"] = memory

    def gather(self) -> None:
        """Every rank takes part: one all-gather of each rank's interval sums."""
        intervals = [Interval.from_floats(v) for v in all_gather_floats(self.clock.take().as_floats(), self.world)]
        if self.is_main:
            summary = summarize(intervals, self.nodes)
            verdict = self.watch.verdict(summary)
            for s in verdict["stragglers"]:
                log.warning("straggler: %s (ranks %s): %s", s["node"], s["ranks"], "; ".join(s["why"]))
            if "layout_verdict" in verdict and not self.layout_logged:
                self.layout_logged = True  # the same every interval: once
                log.warning("low CPU on every node: %s", verdict["layout_verdict"]["text"])
            w = self.watch
            thresholds = {"cpu_util": w.min_util, "compute_ratio": w.ratio, "intervals": w.intervals}
            loaded = {k: v for k, v in self.pending.items() if k == "memory_loaded"}  # until the first row
            self.pending = {**loaded, "rank_stats": {**summary, "thresholds": thresholds}, **verdict}

    def take_row(self) -> dict:
        row, self.pending = self.pending, {}
        return row


class Progress:
    """Rank 0's progress: a bar on a terminal; under mpirun (a pipe) whole log lines about every 5 % instead,
    since a bar's carriage returns glue other ranks' lines onto it in the job log."""

    def __init__(self, job: Job) -> None:
        from tqdm.auto import tqdm

        cfg = job.run.cfg
        self.total = cfg.max_train_steps
        self.bar = tqdm(
            total=cfg.max_train_steps,
            initial=job.run.start_step,
            desc=cfg.method.replace("_", " "),
            dynamic_ncols=True,
            mininterval=0.5,
            disable=not sys.stderr.isatty(),
        )
        self.log_every = max(1, cfg.max_train_steps // 20)

    def on_step_end(self, end: StepEnd) -> None:
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{end.loss:.4f}", s_per_step=f"{end.seconds:.2f}")
        if self.bar.disable and (end.step % self.log_every == 0 or end.step == self.total):
            log.info("step %d/%d loss %.4f %.2f s/step", end.step, self.total, end.loss, end.seconds)

    def close(self) -> None:
        self.bar.close()


class MetricsRows:
    """Rank 0: a row in ``metrics.partial.jsonl`` every ``--log_every`` steps and after the last, with what
    ``extras`` adds (the counters, the gathered rank statistics)."""

    def __init__(
        self,
        job: Job,
        metrics: MetricsLog,
        extras: list[Callable[[], dict]],
        force: ValidationLoss | None = None,
        tracker: Tracker | None = None,
    ) -> None:
        self.job = job
        self.metrics = metrics
        self.extras = extras
        self.force = force  # a validation loss waiting for its row makes a row whatever --log_every says
        self.tracker = tracker

    def on_step_end(self, end: StepEnd) -> None:
        cfg = self.job.run.cfg
        pending = self.force is not None and self.force.value is not None
        if end.step % cfg.log_every == 0 or end.step == cfg.max_train_steps or end.stopping or pending:
            row = self.row(end)
            self.metrics.append(row)
            if self.tracker is not None:
                self.tracker.log_row(row)

    def row(self, end: StepEnd) -> dict:
        job, cfg = self.job, self.job.run.cfg
        row = {
            "step": end.step,
            "loss": end.loss,
            "lr": job.training.lr_scheduler.get_last_lr()[0],
            "s_per_step": end.seconds,
            "images_per_s": job.global_batch * cfg.gradient_accumulation_steps / end.seconds,
            "ranks": job.world,
            "backend": job.cluster.backend or "none",
            "method": cfg.method,
            "allreduce_bytes": job.allreduce_bytes(),
            "time": time.time(),
        }
        for extra in self.extras:
            row.update(extra())
        return row


class Checkpoints:
    """Rank 0: the method's own snapshots after each step, and a checkpoint every ``--checkpointing_steps``. The
    last step is checkpointed too (a crash while the result is saved loses nothing), and the step a stop comes at."""

    def __init__(self, job: Job) -> None:
        self.job = job

    def on_step_end(self, end: StepEnd) -> None:
        cfg = self.job.run.cfg
        if self.job.is_main:
            self.job.training.method.periodic_save(cfg.output_path, end.step)
        every = cfg.checkpointing_steps
        if end.stopping or (every and (end.step % every == 0 or end.step == cfg.max_train_steps)):
            self.save(end.step)

    def save(self, step: int) -> None:
        run, training = self.job.run, self.job.training
        with self.job.cluster.timeout.watch("gather of the checkpoint's state"):  # from every rank with --fsdp
            method_state = training.method.state()
            optimizer_state = training.method.optimizer_state(training.optimizer)
        if not self.job.is_main:
            return
        state = {
            "method": run.cfg.method,
            "base_model": run.base_model,
            "step": step,
            "seed": run.seed,
            "method_state": method_state,
            "optimizer": optimizer_state,
            "lr_scheduler": training.lr_scheduler.state_dict(),
            "global_batch": self.job.global_batch,
            "config": asdict(run.cfg),
        }
        ckpt.save_checkpoint(run.cfg.output_path, step, state, keep=run.cfg.checkpoints_total_limit)


class ValidationImages:
    """Every ``--validation_steps``: rank 0 renders the validation prompt's images, the others wait at a barrier.
    That takes minutes on a CPU, so the set-up timeout applies instead of the step's."""

    def __init__(self, job: Job, tracker: Tracker | None = None) -> None:
        self.job = job
        self.tracker = tracker

    def on_step_end(self, end: StepEnd) -> None:
        job, cfg = self.job, self.job.run.cfg
        if end.step % cfg.validation_steps:  # (not after a stop's step: the sequence leaves it out)
            return
        with job.cluster.timeout.scope(job.cluster.timeouts.setup_s):
            if job.is_main or job.sharded:  # sharded (--fsdp): rank 0's denoiser calls need every rank's shards
                out = cfg.output_path / "validation" / f"step-{end.step}" if job.is_main else None
                render_validation(cfg, job.training.models, out, job.run.seed)
                if self.tracker is not None:  # (rank 0's)
                    self.tracker.log_images(end.step, out)
            with job.cluster.timeout.watch("barrier after the validation images"):
                barrier(job.world)


class ValidationLoss:
    """Every ``--validation_steps`` and after the last step: the loss on the held-out images
    (:mod:`xeonsd.trainer.validation`), every rank its share, one all-reduce; rank 0 logs it and puts it on the
    step's metrics row as ``val_loss``. Under the set-up timeout: an evaluation can take longer than a step."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.value: float | None = None

    def on_step_end(self, end: StepEnd) -> None:
        job, cfg = self.job, self.job.run.cfg
        if end.step % cfg.validation_steps and end.step != cfg.max_train_steps:
            return
        vs = job.data.validation
        assert vs is not None
        t0 = time.perf_counter()
        timeout = job.cluster.timeout
        with timeout.scope(job.cluster.timeouts.setup_s), timeout.watch("all-reduce of the validation loss"):
            self.value = validation_loss(vs, job.loss_inputs(), job.cluster.info.rank, job.world, cfg.train_batch_size)
        if job.is_main:
            log.info(
                "validation loss at step %d: %.5f (%d held-out image(s) x %d timesteps, %.1f s)",
                end.step,
                self.value,
                len(vs.held.images),
                len(vs.timesteps),
                time.perf_counter() - t0,
            )

    def take_row(self) -> dict:
        value, self.value = self.value, None
        return {} if value is None else {"val_loss": value}
