"""The prompts of LoRA and full fine-tuning: each image's caption, or one instance prompt for all."""

from __future__ import annotations

from typing import TYPE_CHECKING

from xeonsd.config import ConfigError
from xeonsd.data import PromptTable

if TYPE_CHECKING:
    from xeonsd.captions import Captions


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
