"""What a run trains on as text: the prompt table (one caption per image, the textual inversion templates, or one
instance prompt for all), built per method from the captions and the flags."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from xeonsd.trainer.config import ConfigError

if TYPE_CHECKING:
    from xeonsd.trainer.captions import Captions
    from xeonsd.trainer.data import Example


@dataclass(frozen=True)
class PromptTable:
    """The prompts a run trains on: one per image (captions), or a few that every image shares (the textual
    inversion templates, or one instance prompt) of which each example draws one."""

    texts: tuple[str, ...]
    per_image: bool
    source: str  # "captions.txt", "templates", "--instance_prompt", …
    # where the text encoder reads reference images beside the prompt (Qwen-Image-Edit): each row's
    references: tuple[tuple[Path, ...], ...] | None = None

    def with_references(self, references: list[tuple[Path, ...]]) -> PromptTable:
        """This table with each image's reference images (``references[i]``: image i's), one row per image: a
        caption per image keeps its rows, one instance prompt becomes that prompt on every image's row (an example
        draws the same text, so the sampling plan does not change)."""
        if self.per_image:
            assert len(self.texts) == len(references), "a caption per image"
            return dataclasses.replace(self, references=tuple(references))
        if len(self.texts) != 1:
            raise ConfigError(
                f"{self.source}: {len(self.texts)} prompts that every image draws from; a model whose text encoder "
                "reads the reference images trains on one prompt per image (captions, or one --instance_prompt)"
            )
        return PromptTable(self.texts * len(references), True, self.source, tuple(references))

    @property
    def num_templates(self) -> int:
        """How many prompts an example draws from (the sampling plan's choice; 1 when captions decide)."""
        return 1 if self.per_image else len(self.texts)

    def row(self, example: Example) -> int:
        return example.input_id // 2 if self.per_image else example.template


def check_prompt_source(method: str, cfg, use_captions: bool) -> None:
    if not use_captions and not cfg.instance_prompt:
        raise ConfigError(
            f"--method {method} without captions needs --instance_prompt (e.g. 'a photo of sks dog'), or "
            f"captions in {cfg.train_data_dir} (metadata.jsonl, a .txt file beside each image, or captions.txt)"
        )


def plain_prompts(cfg, use_captions: bool, captions: Captions | None) -> PromptTable:
    if use_captions:
        assert captions is not None
        return PromptTable(captions.texts, per_image=True, source=captions.source)
    return PromptTable((cfg.instance_prompt,), per_image=False, source="--instance_prompt")
