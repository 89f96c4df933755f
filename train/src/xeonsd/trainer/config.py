"""The trainer's configuration: one typed field per command-line flag, with the seed recipe's flag names.

The recipe (diffusers' ``examples/textual_inversion/textual_inversion.py``) spells flags with underscores;
they are kept verbatim so its command line works after ``xeonsd train``. Each field says which training methods
it belongs to (none: every method); ``xeonsd train --help`` groups the flags by method, and a flag given for
another method than ``--method`` is refused: :mod:`.argv` makes the command line from these fields.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import dataclass
from pathlib import Path

from xeonsd.contracts.method_names import ADAPTERS, METHODS
from xeonsd.contracts.straggler_rule import STRAGGLER_RATIO
from xeonsd.flags import flag

TI, LORA, FULL = METHODS
SHARED_WEIGHTS_DIR = "/dev/shm/xeonsd-weights-{uid}"  # a tmpfs on every Linux node; {uid}: the account's
ATTENTION_KINDS = ("fold", "sdpa")  # --attention (xeonsd.trainer.attention)
BASE_PRECISIONS = ("dtype", "int8")  # --base_precision (xeonsd.trainer.methods.int8_base)
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")


class ConfigError(ValueError):
    """A flag value that cannot work; raised before any model is loaded."""


def _flag(help: str, *, methods: tuple[str, ...] = (), needs: str | None = None, **kw: typing.Any) -> typing.Any:
    """A field and its flag (:func:`xeonsd.flags.flag`), with the methods it belongs to (none: every method) and
    the flag it ``needs`` (acts only when that flag is on; the playbooks' argument list leaves it out otherwise)."""
    return flag(help, meta={"methods": methods, "needs": needs}, **kw)


def _resolution(value: str) -> int | None:
    """``--resolution N``, or ``auto``: the model's (as when the flag is left out)."""
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a side in pixels or auto, not {value!r}") from None


@dataclass
class TrainConfig:
    """Everything one training run needs; ``xeonsd train --help`` lists these fields as flags."""

    pretrained_model_name_or_path: str = _flag("diffusers pipeline directory or Hub id of the base model")
    train_data_dir: str = _flag(
        "directory with the training images, and optionally their captions (metadata.jsonl, <image>.txt beside "
        "each image, or captions.txt)"
    )
    method: str = _flag(
        "what is trained: textual_inversion (the concept's token vectors), lora (low-rank adapters on the UNet's "
        "attention), full (the whole UNet)",
        default=TI,
        choices=METHODS,
    )
    placeholder_token: str | None = _flag(
        "the new token that stands for the concept, e.g. '<dicoo>'", methods=(TI,), default=None
    )
    initializer_token: str | None = _flag(
        "an existing single-token word whose embedding initialises the concept", methods=(TI,), default=None
    )
    output_dir: str = _flag("where embeddings, metrics, checkpoints go", default="text-inversion-model")
    learnable_property: str = _flag(
        "what the concept is (picks the prompt templates)", methods=(TI,), default="object", choices=("object", "style")
    )
    num_vectors: int = _flag("embedding vectors that make up the concept", methods=(TI,), default=1)
    captions: str = _flag(
        "use the data dir's captions: auto (when it has them), on (required), off (textual inversion: the prompt "
        "templates; lora/full: --instance_prompt)",
        default="auto",
        choices=("auto", "on", "off"),
    )
    caption_column: str = _flag("the caption field of metadata.jsonl", default="text")
    cond_image_column: str | None = _flag(
        "edit training on image pairs: the metadata.jsonl field naming each training image's reference image (a path "
        "relative to the data dir, outside the training images), which conditions the model (FLUX.2 [klein] "
        "img2img, as diffusers' train_dreambooth_lora_flux2_klein_img2img.py); the training image is the edited "
        "result. Unset: text-to-image",
        methods=(LORA, FULL),
        default=None,
    )
    caption_dropout: float = _flag(
        "probability that an example trains on the empty caption (the unconditional case classifier-free guidance "
        "needs; kohya's caption_dropout_rate); 0: off",
        methods=(LORA, FULL),
        default=0.0,
    )
    shuffle_tags: bool = _flag(
        "shuffle each caption's comma-separated tags, per example (needs captions; kohya's shuffle_caption)",
        default=False,
    )
    keep_tokens: int = _flag(
        "with --shuffle_tags: the first N tags of each caption stay in place (e.g. the trigger word)",
        default=0,
        needs="shuffle_tags",
    )
    caption_prefix: str | None = _flag(
        "put this in front of every caption, e.g. the trigger word 'sks' (needs captions)",
        methods=(LORA, FULL),
        default=None,
    )
    instance_prompt: str | None = _flag(
        "the prompt of every image when there are no captions (DreamBooth style, e.g. 'a photo of sks dog')",
        methods=(LORA, FULL),
        default=None,
    )
    with_prior_preservation: bool = _flag(
        "DreamBooth prior preservation: every step also trains on as many class images (--class_prompt), the "
        "loss weighted by --prior_loss_weight, so the model keeps what the class looked like",
        methods=(LORA, FULL),
        default=False,
    )
    class_prompt: str | None = _flag(
        "with --with_prior_preservation: the class's prompt, e.g. 'a photo of a dog'",
        methods=(LORA, FULL),
        needs="with_prior_preservation",
        default=None,
    )
    class_data_dir: str | None = _flag(
        "with --with_prior_preservation: the class images; missing ones are generated there from the base model "
        "and kept for the next run",
        methods=(LORA, FULL),
        needs="with_prior_preservation",
        default=None,
    )
    num_class_images: int = _flag(
        "with --with_prior_preservation: class images the run uses (generated when --class_data_dir has fewer)",
        methods=(LORA, FULL),
        needs="with_prior_preservation",
        default=100,
    )
    prior_loss_weight: float = _flag(
        "with --with_prior_preservation: the class loss's weight (loss = instance + W x class)",
        methods=(LORA, FULL),
        needs="with_prior_preservation",
        default=1.0,
    )
    class_export: str | None = _flag(
        "with --with_prior_preservation: an OpenVINO export of the base model (xeonsd export), or a directory of "
        "exports (export.yml's base-model cache); the missing class images are rendered through it on the ranks "
        "whose node holds it, else with PyTorch",
        methods=(LORA, FULL),
        needs="with_prior_preservation",
        default=None,
    )
    adapter: str = _flag(
        "lora, dora (+ a magnitude per output), lokr (Kronecker), loha (Hadamard product); lokr and loha save peft's "
        "layout: adapter_model.safetensors + adapter_config.json (trainer/methods/adapters.py)",
        methods=(LORA,),
        default="lora",
        choices=ADAPTERS,
    )
    rank: int = _flag("LoRA/DoRA's inner dim, LoHa's of both products, LoKr's of w2", methods=(LORA,), default=4)
    lora_alpha: float | None = _flag("adapter alpha (scale alpha/rank; default: --rank)", methods=(LORA,), default=None)
    lora_target_modules: str | None = _flag(
        "comma-separated names of the linear layers that get adapters (default: the attention projections, "
        "to_q,to_k,to_v,to_out.0; FLUX.1 and SD3 also their context stream's add_q_proj,add_k_proj,add_v_proj,"
        "to_add_out, as diffusers' scripts)",
        methods=(LORA,),
        default=None,
        aliases=("--lora_layers",),
    )
    save_format: str = _flag(
        "the LoRA file's layout: diffusers (load_lora_weights) or kohya (lora_unet_…/lora_te_… with .alpha, SDXL "
        "lora_te1_…/lora_te2_…: AUTOMATIC1111, Forge, ComfyUI; diffusers reads it too); comfyui: the result as by "
        "default and beside it comfyui_lora.safetensors, every family's and adapter type's in the layout ComfyUI "
        "loads",
        methods=(LORA,),
        default="diffusers",
        choices=("diffusers", "kohya", "comfyui"),
    )
    train_text_encoder: bool = _flag("adapters on the text encoder's attention too", methods=(LORA,), default=False)
    gradient_checkpointing: bool = _flag(
        "recompute the UNet's activations in the backward pass (less memory, ~30%% more time)",
        methods=(LORA, FULL),
        default=False,
    )
    max_grad_norm: float = _flag("clip the gradient's norm to this (0: no clipping)", methods=(LORA, FULL), default=1.0)
    use_ema: bool = _flag("save an exponential moving average of the UNet's weights", methods=(FULL,), default=False)
    ema_decay: float = _flag("EMA decay per step", methods=(FULL,), default=0.9999)
    fsdp: bool = _flag(
        "shard the denoiser's weights, gradients and AdamW state over all the job's ranks (PyTorch FSDP2) instead of "
        "a whole copy on every rank: a full fine-tune of a model one rank cannot hold (xeonsd.trainer.sharding)",
        methods=(FULL,),
        default=False,
    )
    resolution: int | None = _flag(
        "training image side in pixels (multiple of 8; auto or left out: the model's, 1024 for SDXL, 512 for SD "
        "1.x/2.x)",
        default=None,
        type=_resolution,
    )
    center_crop: bool = _flag("crop the centre square before resizing", default=False)
    random_flip: bool | None = _flag(
        "mirror half of the examples (--no-random_flip: none); left out: as the method's recipe, textual inversion "
        "flips, lora and full do not (docs/trainer.md#mirrored-examples)",
        default=None,
        negatable=True,
    )
    buckets: bool = _flag(
        "aspect-ratio buckets: each image trains at the bucket size nearest its aspect ratio, of about "
        "--resolution squared pixels (never upscaled; with --center_crop the bucket is cut from its centre, "
        "without the image is resized to it); a global batch comes from one bucket",
        default=False,
    )
    min_bucket_reso: int | None = _flag(
        "with --buckets: the smallest bucket side (a multiple of --bucket_reso_steps; default: --resolution / 2)",
        default=None,
    )
    max_bucket_reso: int | None = _flag(
        "with --buckets: the largest bucket side (a multiple of --bucket_reso_steps; default: 2 x --resolution)",
        default=None,
    )
    bucket_reso_steps: int = _flag("with --buckets: bucket sides are multiples of this (of 8)", default=64)
    train_batch_size: int = _flag("images per rank per micro-step", default=16)
    gradient_accumulation_steps: int = _flag("micro-steps per optimizer step", default=1)
    max_train_steps: int = _flag("optimizer steps", default=5000)
    learning_rate: float = _flag("initial learning rate (before --scale_lr)", default=1e-4)
    scale_lr: bool = _flag("multiply the lr by accumulation x batch x world size", default=False)
    lr_scheduler: str = _flag("learning-rate schedule", default="constant", choices=LR_SCHEDULERS)
    lr_warmup_steps: int = _flag("warm-up optimizer steps", default=500)
    adam_beta1: float = _flag("AdamW beta1", default=0.9)
    adam_beta2: float = _flag("AdamW beta2", default=0.999)
    adam_weight_decay: float = _flag("AdamW weight decay", default=1e-2)
    adam_epsilon: float = _flag("AdamW epsilon", default=1e-8)
    fused_adamw: bool = _flag(
        "fused CPU AdamW; --no-fused_adamw: torch's per-tensor loop", default=True, negatable=True
    )
    base_precision: str = _flag(
        "the denoiser's frozen linear layers: dtype (the training dtype) or int8 (int8 weights per channel and "
        "inputs per token, on AMX-INT8 where the CPU has it; adapters keep the dtype: trainer/methods/int8_base.py)",
        methods=(LORA,),
        default="dtype",
        choices=BASE_PRECISIONS,
    )
    fused_lora: bool = _flag(
        "LoRA adapters in the compute dtype, their sum fused into a matmul (trainer/methods/lora_layer.py); "
        "--no-fused_lora: peft's forward, fp32 copies of every adapter's input and output",
        methods=("lora",),
        default=True,
        negatable=True,
    )
    seed: int | None = _flag("random seed (the run is reproducible for a given seed)", default=None)
    snr_gamma: float | None = _flag(
        "min-SNR-gamma loss weighting (Hang et al. 2023; 5 is the paper's): each example's MSE weighted by "
        "min(SNR(t), gamma)/SNR(t) (epsilon prediction) or /(SNR(t)+1) (v prediction); default: off",
        default=None,
    )
    noise_offset: float = _flag(
        "offset noise: add this x N(0,1) per example and latent channel to the noise (diffusers' train scripts; "
        "0.05-0.1 helps very dark or bright images); 0: off",
        default=0.0,
    )
    timestep_range: str | None = _flag(
        "lo,hi: draw the timesteps uniformly in [lo, hi), 0 <= lo < hi <= the scheduler's num_train_timesteps "
        "(default: the whole range)",
        default=None,
    )
    masks: str | None = _flag(
        "masked loss: a directory with one grey-scale mask per training image, of its file stem and size "
        "(DIR/p0.png for p0.jpg); white counts, black does not, grey weighs between (each example's loss "
        "normalised by its mask's area); the validation loss stays unmasked. Default: off",
        default=None,
    )
    weighting_scheme: str | None = _flag(
        "flow models (FLUX.1, SD3): how sigma is drawn and weighted, as diffusers' scripts: logit_normal, mode "
        "(sigma's density), uniform or none (uniform sigma, no weight), sigma_sqrt or cosmap (uniform sigma, "
        "those loss weights); default: the family's script's (FLUX.1 none, SD3 logit_normal)",
        default=None,
    )
    logit_mean: float = _flag("flow models, --weighting_scheme logit_normal: the normal's mean", default=0.0)
    logit_std: float = _flag("flow models, --weighting_scheme logit_normal: the normal's std", default=1.0)
    mode_scale: float = _flag("flow models, --weighting_scheme mode: the mode scale", default=1.29)
    guidance_scale: float = _flag("FLUX.1-dev (guidance-embedding): its guidance input in training", default=3.5)
    mixed_precision: str = _flag(
        "bf16: frozen UNet/VAE in bf16 on AMX; auto: bf16 where the CPU has AMX or AVX512-BF16, else no",
        default="no",
        choices=("no", "bf16", "fp16", "auto"),
    )
    overwrite_output_dir: bool = _flag("replace an earlier run's results in output_dir with a new run", default=False)
    save_as_full_pipeline: bool = _flag("also save a complete pipeline with the concept", methods=(TI,), default=False)
    save_steps: int = _flag("learned_embeds-steps-N.safetensors every N steps (0: never)", methods=(TI,), default=0)
    checkpointing_steps: int = _flag("write a resumable checkpoint every N steps (0: never)", default=500)
    checkpoints_total_limit: int | None = _flag("keep at most this many checkpoints", default=None)
    resume_from_checkpoint: str | None = _flag(
        "a checkpoint directory; 'latest': the newest in output_dir (refused when there is none); "
        "'latest_if_any': the newest, or a new run when there is none",
        default=None,
    )
    validation_prompt: str | None = _flag("prompt for validation images", default=None)
    inference_model: str | None = _flag(
        "diffusers pipeline directory or Hub id of another model of the base model's family whose denoiser, with "
        "the adapters being trained, renders the validation images (Krea 2: train on RAW, validate on Turbo, as "
        "diffusers' --validation_model_path); recorded in train_summary.json. Unset: the base model renders them",
        methods=(LORA,),
        default=None,
    )
    num_validation_images: int = _flag("images per validation", default=4)
    validation_steps: int = _flag("validation images and validation loss every N steps", default=100)
    validation_split: float = _flag(
        "hold this fraction of the images out of training (at least one; chosen by file name, the same in every "
        "run) and log the loss on them every --validation_steps; 0: off",
        default=0.0,
    )
    validation_data_dir: str | None = _flag(
        "held-out images (and their captions, in the layouts of --train_data_dir) for the validation loss",
        default=None,
    )
    dataloader_num_workers: int = _flag("worker threads that decode images for the latent cache", default=0)
    revision: str | None = _flag("model revision on the Hub", default=None)
    variant: str | None = _flag("model file variant, e.g. fp16", default=None)
    # Options of ours (not in the recipe): the speed paths and their baselines, for the benchmark.
    latent_cache_dir: str | None = _flag(
        "keep the latent cache on disk here between runs (keyed by image content, VAE and resolution)", default=None
    )
    dry_run: bool = _flag(
        "check the inputs, print the estimated peak memory per rank and stop (refused when it exceeds free memory)",
        default=False,
        aliases=("--dry-run",),
    )
    latent_cache: bool = _flag(
        "encode each distinct input once and sample its cached latent distribution (--no-latent_cache: "
        "encode with the VAE every step, as the recipe did)",
        default=True,
        negatable=True,
    )
    train_full_embedding_matrix: bool = _flag(
        "baseline: train and all-reduce the whole embedding matrix as the recipe did", methods=(TI,), default=False
    )
    channels_last: bool = _flag("UNet in channels_last memory format", default=False)
    attention: str = _flag(
        "the denoiser's attention: fold (torch's SDPA, with the queries split into blocks folded into the batch "
        "where batch x heads leave threads idle in its backward; exact: trainer/attention.py) or sdpa (torch's "
        "SDPA as it is)",
        default="fold",
        choices=ATTENTION_KINDS,
    )
    compile: bool = _flag("torch.compile the UNet", default=False)
    phased_loading: bool = _flag(
        "load the denoiser last, after the prompts are encoded and the latents cached, with a long text encoder and "
        "the VAE freed (LoRA and full fine-tuning without prior preservation); --no-phased_loading: every model at "
        "once",
        default=True,
        negatable=True,
    )
    share_weights: str = _flag(
        "map the frozen models (the VAE, the text encoders, and the denoiser unless it trains) from one node-local "
        "file that all the node's ranks share, instead of a copy per rank (auto: when the node runs more than one "
        "of the job's ranks; xeonsd.trainer.shared_weights)",
        default="auto",
        choices=("auto", "on", "off"),
    )
    shared_weights_dir: str = _flag(
        "the node-local directory of --share_weights' files ({uid}: the account's user id; a tmpfs by default, a "
        "local disk directory works too)",
        default=SHARED_WEIGHTS_DIR,
    )
    keep_shared_weights: bool = _flag("keep the node's shared weights after the last job on the base", default=False)
    use_ipex: str = _flag("apply ipex.optimize when IPEX imports", default="auto", choices=("auto", "on", "off"))
    count_flops: bool = _flag("count the first step's FLOPs into metrics (torch.utils.flop_counter)", default=False)
    profile_step: int = _flag(
        "record step N (1-based; 0: none) with torch.profiler and write its seconds per class of work (attention, "
        "convolutions, matmuls, norms + elementwise, optimizer) into its metrics row; with --count_flops the first "
        "step's FLOPs are split the same way (xeonsd bench train --profile reads both)",
        default=0,
    )
    log_every: int = _flag("metrics line every N steps", default=1)
    report_to: str = _flag(
        "also log the curves and validation images to TensorBoard (event files in OUTPUT_DIR/tensorboard) or MLflow",
        default="none",
        choices=("none", "tensorboard", "mlflow"),
    )
    tracking_uri: str | None = _flag(
        "--report_to mlflow: the tracking server or store (default: MLFLOW_TRACKING_URI, else ./mlruns)", default=None
    )
    stats_every: int = _flag(
        "every N steps the ranks exchange their CPU utilisation and time split (one small all-gather) and rank 0 "
        "adds them to the next metrics line",
        default=5,
    )
    straggler_cpu_util: float = _flag(
        "a node whose ranks stay under this CPU utilisation (0-1) for 3 stats intervals is reported as a straggler",
        default=0.8,
    )
    straggler_ratio: float = _flag(
        "a node whose compute time per step is above this multiple of the median node's is reported as a straggler",
        default=STRAGGLER_RATIO,
    )
    world_size: int | None = _flag("expected number of ranks (checked against what the launcher reports)", default=None)

    @property
    def output_path(self) -> Path:
        return Path(self.output_dir)
