"""The two summary files of a run directory, whose schemas are defined here once.

* ``train_summary.json`` (:func:`train_summary`): what trained, written by rank 0 when the result is saved. The
  openvino_export role reads ``method``, ``base_model``, ``base_model_fingerprint`` and ``result.path``; the finetune
  role ``result.bytes``; ``xeonsd report`` all of it.
* ``run.json`` (:func:`run_json`): the cluster and the phase times of the play that made the run (and the Slurm
  job's id and accounting from ``slurm.json`` when it ran under Slurm: :mod:`.slurm_job`), written on the
  primary by the run_report role through ``xeonsd runjson RUN_DIR`` (:mod:`xeonsd.jobs.cli`; the play's facts as
  JSON on stdin: :data:`RUN_JSON_INPUT`); ``xeonsd report`` adds its ``cluster_figures``.

Every file is written under a temporary name and renamed into place (:func:`job_status.write_json`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from xeonsd.contracts.job_status import read_exit
from xeonsd.contracts.method_names import METHOD_FILES
from xeonsd.contracts.slurm_job import read_slurm_job

TRAIN_SUMMARY_FILE = "train_summary.json"
RUN_JSON_FILE = "run.json"
# --report_to tensorboard's event files, in the run directory (the finetune role fetches them, the report links them)
TENSORBOARD_DIR = "tensorboard"
# The phases of run.json, by the name the report shows.
TRAINING_WALL = "training job, wall (s)"
EXPORT_S = "OpenVINO export (s)"
GENERATE_S = "generate, whole command (s)"
# What the run_report role passes on stdin (null or absent: that part did not run in this play).
RUN_JSON_INPUT = ("run", "nodes", "mpi_ranks", "ranks_per_node", "primary", "export", "generate", "cost")
# train_summary.json's prompts: where they came from, how many, and the caption draws (when the trainer gives them).
PROMPT_FIELDS = ("source", "count", "per_image", "caption_dropout", "shuffle_tags", "keep_tokens", "caption_prefix")


def train_summary(
    method_summary: dict,
    *,
    base_model: str,
    base_model_fingerprint: str,
    steps: int,
    ranks: int,
    allreduce_bytes_per_step: int,
    prompts: dict,
    result_path: str,
    result_bytes: int,
    loss: dict | None = None,
    family: str | None = None,
    family_label: str | None = None,
    resolution: int | None = None,
    validation: dict | None = None,
    buckets: dict | None = None,
    startup: dict | None = None,
    prior: dict | None = None,
    inference_model: str | None = None,
    sample_references: list[str] | None = None,
    cond_image_column: str | None = None,
    data_dir: str | None = None,
) -> dict:
    """train_summary.json: the method's own figures (``method``, ``trainable_params``, …), the base model and its
    fingerprint, the steps and ranks, the bytes all-reduced per step, the prompts (source, count, per_image, and when
    given the caption draws: ``caption_dropout``, ``shuffle_tags``, ``keep_tokens``, ``caption_prefix``), the
    result (its path in the run directory and its size) and, when given, the loss options (``snr_gamma``: None when
    off, ``noise_offset``, ``timestep_range``: the [lo, hi) drawn from; a flow model's: ``objective`` ``flow``,
    ``weighting_scheme``, ``logit_mean``, ``logit_std``, ``mode_scale``, ``shift`` (a number, or "dynamic
    (resolution-dependent)"), ``guidance_scale`` (FLUX.1-dev, else None)), the base model's ``family`` (``sd``,
    ``sdxl``, ``flux``, ``sd3``: :mod:`xeonsd.families`) and its ``family_label`` (SD 1.x/2.x, SDXL,
    FLUX.1, SD3/SD3.5: what the play and the report show), the ``resolution`` trained at and the validation loss's held-out images
    (``validation``: ``source``, ``images``, ``timesteps``), the aspect-ratio buckets (``buckets``: ``step``,
    ``min_reso``, ``max_reso``, and ``buckets``: each one's ``width``, ``height`` and ``images``) and the start-up
    (``startup``: ``time_to_first_step_s`` from the trainer's start, ``cpu_s_to_first_step`` of rank 0's process
    from its own start, the latent cache's ``latent_inputs``, ``latent_inputs_encoded`` by the VAE, the rest
    read from the disk cache, and ``shared_weights_bytes``: each frozen component mapped from the node's shared file
    and its bytes, empty when the ranks hold private copies, and ``shared_weights_held_bytes``: those still mapped
    when the run ended, the rest released once the prompts were encoded and the latents cached) and DreamBooth prior preservation's settings (``prior``: ``class_prompt``,
    ``class_data_dir``, ``num_class_images``, ``prior_loss_weight``), the model the validation images were
    rendered with, where another model of the family than the base renders them (``inference_model``: Krea 2
    Turbo for a LoRA trained on RAW) and, for edit training on image pairs, the reference images the validation
    images are edits of (``sample_references``: the first training image's, as absolute paths; the openvino_export
    role gives them to ``xeonsd generate --image``) and the metadata.jsonl field that named each image's references
    (``cond_image_column``), and the training images' directory (``data_dir``, absolute: the report's before and after
    rows are measured against its images)."""
    return {
        **method_summary,
        "base_model": base_model,
        "base_model_fingerprint": base_model_fingerprint,
        "steps": steps,
        "ranks": ranks,
        "allreduce_bytes_per_step": allreduce_bytes_per_step,
        "prompts": {k: prompts[k] for k in PROMPT_FIELDS if k in prompts},
        "result": {"path": result_path, "bytes": result_bytes},
        **({"loss": dict(loss)} if loss is not None else {}),
        **({"family": family} if family is not None else {}),
        **({"family_label": family_label} if family_label is not None else {}),
        **({"resolution": resolution} if resolution is not None else {}),
        **({"validation": dict(validation)} if validation is not None else {}),
        **({"buckets": dict(buckets)} if buckets is not None else {}),
        **({"startup": dict(startup)} if startup is not None else {}),
        **({"prior": dict(prior)} if prior is not None else {}),
        **({"inference_model": inference_model} if inference_model is not None else {}),
        **({"sample_references": list(sample_references)} if sample_references else {}),
        **({"cond_image_column": cond_image_column} if cond_image_column else {}),
        **({"data_dir": data_dir} if data_dir else {}),
    }


def hms_seconds(delta: object) -> float | None:
    """Seconds of Ansible's ``delta`` of a command ("H:MM:SS.ffffff"); None when the command did not run."""
    parts = str(delta or "").split(":")
    if len(parts) != 3:
        return None
    try:
        return round(int(parts[0]) * 3600 + int(parts[1]) * 60 + float(parts[2]), 1)
    except ValueError:
        return None


def phases(run_dir: Path, export: dict | None, generate: dict | None) -> dict[str, float]:
    """The training job's wall time (exit.json), the export's and the generation's: a reused export is 0 s."""
    out: dict[str, float] = {}
    ended = read_exit(run_dir)
    if ended is not None:
        out[TRAINING_WALL] = ended.ended - ended.started
    if export is not None:
        seconds = hms_seconds(export.get("delta")) if export.get("changed") else 0.0
        if seconds is not None:
            out[EXPORT_S] = seconds
    seconds = hms_seconds((generate or {}).get("delta"))
    if seconds is not None:
        out[GENERATE_S] = seconds
    return out


def _read_summary(run_dir: Path) -> dict:
    try:
        return json.loads((Path(run_dir) / TRAIN_SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return {}


def run_json(run_dir: Path, facts: dict) -> dict:
    """run.json from the play's ``facts`` (:data:`RUN_JSON_INPUT`) and the run directory's own files."""
    unknown = sorted(set(facts) - set(RUN_JSON_INPUT))
    if unknown:
        raise ValueError(f"unknown run.json input(s) {', '.join(unknown)}; known: {', '.join(RUN_JSON_INPUT)}")
    export, cost = facts.get("export"), facts.get("cost") or {}
    info: dict = {
        "title": f"xeonsd run {facts['run']}",
        "cluster": {
            "nodes": ", ".join(facts["nodes"]),
            "MPI ranks": facts["mpi_ranks"],
            "ranks per node": facts["ranks_per_node"],
            "primary": facts["primary"],
        },
        "phases": phases(run_dir, export, facts.get("generate")),
    }
    job = read_slurm_job(run_dir)
    if job is not None:  # the job ran under Slurm (finetune_launcher: slurm): its id and sacct's accounting
        info["cluster"].update(
            {
                "launcher": "Slurm (sbatch, srun)",
                "Slurm job": f"{job.job_id} ({job.state}, exit {job.exit_code})",
                "Slurm elapsed (s)": job.elapsed_s,
                "Slurm CPU time (s)": "not recorded (no Slurm accounting)"
                if job.cpu_time_s is None
                else job.cpu_time_s,
            }
        )
        if job.stopped_by_time_limit:
            info["cluster"]["Slurm job"] += ": stopped by the time limit, resume with -e resume=latest"
        info["slurm"] = dataclasses.asdict(job)
    if export is not None:
        method = METHOD_FILES.get(_read_summary(run_dir).get("method", ""), {})
        info["export"] = {
            "dir": export["dir"],
            "reused": not export.get("changed"),
            "of": "its own pipeline" if method.get("pipeline") else "the base model (shared by its runs)",
        }
    if str(cost.get("node_hour_price", "")):
        info["cost"] = {k: cost.get(k, "") for k in ("node_hour_price", "currency", "gpu_hour_price", "gpu_s_per_step")}
    return info
