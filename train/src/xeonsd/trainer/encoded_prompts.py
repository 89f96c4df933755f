"""Every prompt table a run conditions on, encoded before any image is: the training prompts', the held-out
captions' (``--validation_split``), the class prompt's (prior preservation) and the validation prompt's. A flow
family's T5 (4.7 B parameters in FLUX.1 and SD3.5) is then freed, so the VAE's encodes of the latent caches never
run beside it: the start-up's peak stays the models' load."""

from __future__ import annotations

from dataclasses import dataclass

from xeonsd.cluster.distributed import barrier
from xeonsd.cluster.launch import RankInfo
from xeonsd.trainer.captions import CaptionDraws
from xeonsd.trainer.conditioning import PromptConditioning
from xeonsd.trainer.config import TrainConfig
from xeonsd.trainer.inputs import Inputs
from xeonsd.trainer.methods import Method
from xeonsd.trainer.models import Models
from xeonsd.trainer.prior import class_text
from xeonsd.trainer.prompt_tables import PromptTable
from xeonsd.trainer.validation import validation_text


@dataclass
class Texts:
    """Every prompt table's conditioning of a run: the training prompts', the held-out captions' and the class
    prompt's (None where the run has none)."""

    train: PromptConditioning
    held: tuple | None
    prior: PromptConditioning | None


def encode_prompts(
    cfg: TrainConfig, info: RankInfo, models: Models, method: Method, inputs: Inputs, prompts: PromptTable, seed: int
) -> Texts:
    """Every prompt the run conditions on, encoded first; then a flow family's T5 is freed, before the VAE
    encodes the images (so the latent caches never hold T5 beside the VAE's activations)."""
    family = models.training
    rank, world = info.rank, info.world_size
    draws = CaptionDraws.for_run(cfg, seed)
    train = family.conditioning(
        models, prompts, trainable=method.trains_text_encoder, rank=rank, world=world, draws=draws
    )
    held = validation_text(cfg, info, models, method, inputs.held_out, inputs.references)
    prior = class_text(cfg, info, models, method.trains_text_encoder) if inputs.class_images else None
    if family.is_flow:  # the validation prompt's table too, then T5 goes
        if cfg.validation_prompt:
            table = PromptTable((cfg.validation_prompt, ""), per_image=False, source="--validation_prompt")
            if models.sample_reference and family.text_reads_references:  # edits of the first image's references
                table = PromptTable(table.texts, True, table.source, (models.sample_reference,) * 2)
            models.sample_conditioning = family.conditioning(
                models, table, trainable=method.trains_text_encoder, rank=rank, world=world
            )
        family.release_long_encoder(models, keep=cfg.shuffle_tags)
        if models.text_pending:  # loaded in phases: the CLIP encoders load now, the long one gone
            barrier(world)  # every rank has let go of T5: none loads them while another still maps it
            models.load_pending()
            for text in (train, held[1] if held else None, models.sample_conditioning):
                if text is not None:
                    text.finish()
    return Texts(train=train, held=held, prior=prior)
