"""What a run trains on as text: the prompt table (one caption per image, the textual inversion templates, or one
instance prompt for all), built per method from the captions and the flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from xeonsd.trainer.config import ConfigError

if TYPE_CHECKING:
    from xeonsd.trainer.captions import Captions
    from xeonsd.trainer.data import Example


OBJECT_TEMPLATES = (
    "a photo of a {}",
    "a rendering of a {}",
    "a cropped photo of the {}",
    "the photo of a {}",
    "a photo of a clean {}",
    "a photo of a dirty {}",
    "a dark photo of the {}",
    "a photo of my {}",
    "a photo of the cool {}",
    "a close-up photo of a {}",
    "a bright photo of the {}",
    "a cropped photo of a {}",
    "a photo of the {}",
    "a good photo of the {}",
    "a photo of one {}",
    "a close-up photo of the {}",
    "a rendition of the {}",
    "a photo of the clean {}",
    "a rendition of a {}",
    "a photo of a nice {}",
    "a good photo of a {}",
    "a photo of the nice {}",
    "a photo of the small {}",
    "a photo of the weird {}",
    "a photo of the large {}",
    "a photo of a cool {}",
    "a photo of a small {}",
)

STYLE_TEMPLATES = (
    "a painting in the style of {}",
    "a rendering in the style of {}",
    "a cropped painting in the style of {}",
    "the painting in the style of {}",
    "a clean painting in the style of {}",
    "a dirty painting in the style of {}",
    "a dark painting in the style of {}",
    "a picture in the style of {}",
    "a cool painting in the style of {}",
    "a close-up painting in the style of {}",
    "a bright painting in the style of {}",
    "a good painting in the style of {}",
    "a close-up painting in the style of {}",
    "a rendition in the style of {}",
    "a nice painting in the style of {}",
    "a small painting in the style of {}",
    "a weird painting in the style of {}",
    "a large painting in the style of {}",
)


def templates_for(learnable_property: str) -> tuple[str, ...]:
    return STYLE_TEMPLATES if learnable_property == "style" else OBJECT_TEMPLATES


@dataclass(frozen=True)
class PromptTable:
    """The prompts a run trains on: one per image (captions), or a few that every image shares (the textual
    inversion templates, or one instance prompt) of which each example draws one."""

    texts: tuple[str, ...]
    per_image: bool
    source: str  # "captions.txt", "templates", "--instance_prompt", …

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
