"""What a finished run records about itself: ``train_summary.json`` (its schema: :func:`xeonsd.contracts.run_files.train_summary`)."""

from __future__ import annotations

from pathlib import Path

from xeonsd.contracts import run_files
from xeonsd.trainer.job import Job
from xeonsd.trainer.metrics import result_bytes


def train_summary(job: Job, first_step_s: float | None = None, first_step_cpu_s: float | None = None) -> dict:
    """What ``train_summary.json`` holds (the schema: :func:`xeonsd.contracts.run_files.train_summary`)."""
    cfg, method, prompts = job.run.cfg, job.training.method, job.data.prompts
    return run_files.train_summary(
        method.summary(),
        base_model=cfg.pretrained_model_name_or_path,
        base_model_fingerprint=job.run.base_model,
        steps=cfg.max_train_steps,
        ranks=job.world,
        allreduce_bytes_per_step=job.allreduce_bytes(),
        prompts={
            "source": prompts.source,
            "count": len(prompts.texts),
            "per_image": prompts.per_image,
            "caption_dropout": cfg.caption_dropout,
            "shuffle_tags": cfg.shuffle_tags,
            "keep_tokens": cfg.keep_tokens,
            "caption_prefix": cfg.caption_prefix,
        },
        result_path=method.outputs[0],
        result_bytes=result_bytes(cfg.output_path, method.outputs[0]),
        loss=loss_options(job),
        family=family.name if (family := job.training.models.family) is not None else None,
        family_label=family.label if family is not None else None,
        resolution=cfg.resolution,
        validation=validation_record(job),
        buckets=job.data.buckets.record() if job.data.buckets is not None else None,
        startup={
            "time_to_first_step_s": first_step_s,
            "cpu_s_to_first_step": first_step_cpu_s,
            "latent_inputs": job.data.latents.inputs,
            "latent_inputs_encoded": job.data.latents.encoded,
            "shared_weights_bytes": dict(store.mapped) if (store := job.training.models.store) is not None else {},
            "shared_weights_held_bytes": store.held if store is not None else {},
        },
        prior=prior_record(job),
        inference_model=cfg.inference_model,
        sample_references=[str(Path(p).resolve()) for p in job.training.models.sample_reference or ()],
        cond_image_column=cfg.cond_image_column,
        data_dir=str(Path(cfg.train_data_dir).resolve()) if cfg.train_data_dir else None,
    )


def validation_record(job: Job) -> dict | None:
    """The validation loss's held-out images (train_summary.json's ``validation``), or None without one."""
    vs = job.data.validation
    if vs is None:
        return None
    return {"source": vs.held.source, "images": [p.name for p in vs.held.images], "timesteps": list(vs.timesteps)}


def prior_record(job: Job) -> dict | None:
    """Prior preservation's settings (train_summary.json's ``prior``), or None without it."""
    cfg = job.run.cfg
    if job.data.prior is None:
        return None
    return {
        "class_prompt": cfg.class_prompt,
        "class_data_dir": cfg.class_data_dir,
        "num_class_images": job.data.prior.count,
        "prior_loss_weight": cfg.prior_loss_weight,
    }


def loss_options(job: Job) -> dict:
    """The loss and noise options the run trained with (train_summary.json's ``loss``)."""
    cfg, plan = job.run.cfg, job.data.plan
    flow = job.training.models.flow
    if flow is not None:  # rectified flow: how σ was drawn and weighted (the report's "σ sampling")
        return {
            "objective": "flow",
            "weighting_scheme": flow.scheme,
            "logit_mean": flow.logit_mean,
            "logit_std": flow.logit_std,
            "mode_scale": flow.mode_scale,
            "shift": "dynamic (resolution-dependent)" if flow.dynamic else flow.shift,
            "guidance_scale": cfg.guidance_scale if (job.training.models.family.guidance_embeds) else None,
        }
    lo, hi = plan.timestep_range or (0, plan.num_timesteps)
    return {"snr_gamma": cfg.snr_gamma, "noise_offset": cfg.noise_offset, "timestep_range": [lo, hi]}
