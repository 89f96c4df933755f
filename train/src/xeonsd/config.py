"""The trainer's configuration: one typed field per command-line flag, with the seed recipe's flag names.

The recipe (diffusers' ``examples/textual_inversion/textual_inversion.py``) spells flags with underscores;
they are kept verbatim so its command line works after ``xeonsd train``.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")


def _flag(help: str, **kw: typing.Any) -> typing.Any:
    default = kw.pop("default", dataclasses.MISSING)
    meta = {"help": help, **kw}
    if default is dataclasses.MISSING:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    """Everything one training run needs; ``xeonsd train --help`` lists these fields as flags."""

    pretrained_model_name_or_path: str = _flag("diffusers pipeline directory or Hub id of the base model")
    train_data_dir: str = _flag("directory with the concept's training images")
    placeholder_token: str = _flag("the new token that stands for the concept, e.g. '<dicoo>'")
    initializer_token: str = _flag("an existing single-token word whose embedding initialises the concept")
    output_dir: str = _flag("where embeddings, metrics, checkpoints go", default="text-inversion-model")
    learnable_property: str = _flag("what the concept is", default="object", choices=("object", "style"))
    num_vectors: int = _flag("embedding vectors that make up the concept", default=1)
    resolution: int = _flag("training image side in pixels (multiple of 8)", default=512)
    center_crop: bool = _flag("crop the centre square before resizing", default=False)
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
    seed: int | None = _flag("random seed (the run is reproducible for a given seed)", default=None)
    mixed_precision: str = _flag(
        "bf16: frozen UNet/VAE in bf16 on AMX; auto: bf16 where the CPU has AMX or AVX512-BF16, else no",
        default="no",
        choices=("no", "bf16", "fp16", "auto"),
    )
    overwrite_output_dir: bool = _flag(
        "start a new run in an output dir that holds an earlier run's results (they are replaced)", default=False
    )
    save_as_full_pipeline: bool = _flag("also save a complete pipeline with the concept", default=False)
    save_steps: int = _flag("write learned_embeds-steps-N.safetensors every N steps (0: never)", default=0)
    checkpointing_steps: int = _flag("write a resumable checkpoint every N steps (0: never)", default=500)
    checkpoints_total_limit: int | None = _flag("keep at most this many checkpoints", default=None)
    resume_from_checkpoint: str | None = _flag("a checkpoint directory, or 'latest' in output_dir", default=None)
    validation_prompt: str | None = _flag("prompt for validation images", default=None)
    num_validation_images: int = _flag("images per validation", default=4)
    validation_steps: int = _flag("validate every N steps", default=100)
    dataloader_num_workers: int = _flag("worker threads that decode images for the latent cache", default=0)
    revision: str | None = _flag("model revision on the Hub", default=None)
    variant: str | None = _flag("model file variant, e.g. fp16", default=None)
    # Options of ours (not in the recipe): the speed paths and their baselines, for the benchmark.
    latent_cache: bool = _flag(
        "encode each distinct input once and sample its cached latent distribution (--no-latent_cache: "
        "encode with the VAE every step, as the recipe did)",
        default=True,
        negatable=True,
    )
    train_full_embedding_matrix: bool = _flag(
        "baseline: train and all-reduce the whole embedding matrix as the recipe did", default=False
    )
    channels_last: bool = _flag("UNet in channels_last memory format", default=False)
    compile: bool = _flag("torch.compile the UNet", default=False)
    use_ipex: str = _flag("apply ipex.optimize when IPEX imports", default="auto", choices=("auto", "on", "off"))
    count_flops: bool = _flag(
        "count the executed FLOPs of the first step (torch.utils.flop_counter) into metrics", default=False
    )
    log_every: int = _flag("metrics line every N steps", default=1)
    world_size: int | None = _flag("expected number of ranks (checked against what the launcher reports)", default=None)

    @property
    def output_path(self) -> Path:
        return Path(self.output_dir)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xeonsd train",
        description="Textual inversion of a Stable Diffusion model on Xeon CPUs, distributed over MPI ranks.",
    )
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        meta = dict(f.metadata)
        help_text = meta.pop("help")
        negatable = meta.pop("negatable", False)
        name = f"--{f.name}"
        required = f.default is dataclasses.MISSING
        hint = hints[f.name]
        base = typing.get_args(hint)[0] if typing.get_origin(hint) in (typing.Union, type(int | None)) else hint
        if base is bool:
            if negatable:
                parser.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            else:
                parser.add_argument(name, action="store_true", default=f.default, help=help_text)
            continue
        kwargs: dict[str, typing.Any] = {"type": base, "help": help_text, **meta}
        if required:
            kwargs["required"] = True
        else:
            kwargs["default"] = f.default
        parser.add_argument(name, **kwargs)
    return parser


def parse_config(argv: list[str]) -> TrainConfig:
    args = build_parser().parse_args(argv)
    return TrainConfig(**vars(args))
