"""What a model family's training side is: the strategy each family module defines one instance of."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, ClassVar

import torch

from xeonsd.trainer.conditioning import PromptConditioning
from xeonsd.trainer.config import ConfigError
from xeonsd.trainer.loss import denoising_loss
from xeonsd.trainer.models import autocast

if TYPE_CHECKING:
    from xeonsd.families.spec import FamilySpec
    from xeonsd.trainer.buckets import Placement
    from xeonsd.trainer.models import Models
    from xeonsd.trainer.prompt_tables import PromptTable


class VAEView:
    """A VAE as the latent cache sees it (what :meth:`TrainFamily.latent_vae` returns where a family's latents are
    not the VAE's own): ``encode(pixels [n, 3, H, W]).latent_dist`` has ``mean`` and ``std`` [n, c, h, w]. ``frames``:
    the VAE takes video (Qwen-Image): one frame in, its axis dropped; ``view``: a rearrangement of both (FLUX.2's
    2x2 patchify); ``mode``: a zero std, so that every draw is ``latent_dist.mode()``, as the family's diffusers
    script encodes (FLUX.2, Z-Image)."""

    def __init__(self, vae, view=None, mode: bool = False, frames: bool = False) -> None:
        self.vae, self.config = vae, vae.config
        self.view, self.mode, self.frames = view or (lambda t: t), mode, frames

    def encode(self, pixels: torch.Tensor):
        dist = self.vae.encode(pixels.unsqueeze(2) if self.frames else pixels).latent_dist
        mean, std = (dist.mean[:, :, 0], dist.std[:, :, 0]) if self.frames else (dist.mean, dist.std)
        mean = self.view(mean)
        std = torch.zeros_like(mean) if self.mode else self.view(std)
        return SimpleNamespace(latent_dist=SimpleNamespace(mean=mean, std=std))


class TrainFamily:
    """A family's training side (its files, classes and export names: its ``spec``): how its prompts condition the model (``conditioning``: the prompt table through its
    text encoders, and what the denoiser call takes besides the latents), what each training image adds
    (``time_ids``), the training objective (``predict``: the noisy input, the denoiser's call and the target;
    ``loss``) and where LoRA's adapters go by default (``lora_targets``). This base is the ε/v-prediction objective
    of a UNet on a DDPM schedule (SD, SDXL); :mod:`.transformer` is rectified flow (FLUX.1, SD3). The memory
    estimate reads the text encoders from the spec."""

    spec: ClassVar[FamilySpec]  # the family's own (its folder's SPEC)
    conditioning: ClassVar[type[PromptConditioning]] = PromptConditioning
    lora_targets: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out.0")
    is_flow: ClassVar[bool] = False
    # the text encoder reads the reference images beside the prompt (Qwen-Image-Edit's Qwen2.5-VL), so a prompt
    # table of edit training has a row per image, with its references (PromptTable.with_references)
    text_reads_references: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return self.spec.name

    def latent_dims(self, vae_config, vae_scale: int, height: int, width: int) -> tuple[int, int, int]:
        """(channels, height, width) of one image's latents as the trainer caches them, from the VAE's own config
        (a family whose VAE output is rearranged before the denoiser, FLUX.2's 2x2 patchified latents, says so here
        and in ``latent_vae``)."""
        return int(vae_config.latent_channels), height // vae_scale, width // vae_scale

    def latent_vae(self, vae):
        """What the latent cache encodes with: an object with the VAE's ``config`` whose ``encode(pixels)`` gives
        ``.latent_dist`` (``mean``, ``std``) of [n, c, h, w] as ``latent_dims`` says. The VAE itself here; a family
        whose VAE takes video frames (Qwen-Image) or whose latents are patchified (FLUX.2) wraps it."""
        return vae

    def latent_affine(self, vae) -> tuple[float | torch.Tensor, float | torch.Tensor]:
        """(shift, scaling) of the denoiser's latents: ``(z - shift) * scaling`` of a VAE sample ``z`` (floats, or
        [c, 1, 1] tensors for a per-channel normalisation)."""
        return getattr(vae.config, "shift_factor", None) or 0.0, vae.config.scaling_factor

    def time_ids(
        self, image: Path, resolution: int, center_crop: bool, placement: Placement | None = None
    ) -> torch.Tensor | None:
        """The micro-conditioning of an image and of its mirror ([2, n]), kept with the cached latents; None: the
        family has none."""
        return None

    def with_references(self, table: PromptTable, references: list[tuple[Path, ...]]) -> PromptTable:
        """The prompt table of edit training on these images' reference images: with them where the text encoder
        reads them (``text_reads_references``), else unchanged (the references reach the denoiser as latents)."""
        return table.with_references(references) if self.text_reads_references else table

    def rendering(self, resolution: int):
        """A context the validation images render in, so that the pipeline runs as the run trained (Qwen-Image-
        Edit: the reference at ``resolution``'s area); nothing here."""
        return contextlib.nullcontext()

    def load_processor(self, src, subfolder: str, tokenizer, **kw):
        """The pipeline's processor (``FamilySpec.processor``), over the loaded ``tokenizer``: none here."""
        raise NotImplementedError(f"{self.spec.label} has no processor")

    def sampling(self, pipeline_config: dict) -> dict:
        """The validation images' sampler arguments for a pipeline with these settings (``Family.pipeline_config``):
        25 steps at the pipeline's own guidance; a distilled checkpoint (Krea 2 Turbo) asks for its own."""
        return {"num_inference_steps": 25}

    def release_long_encoder(self, models: Models, keep: bool) -> None:
        """Free the long text encoder once every prompt table is built: none here (the CLIP-only families keep
        their encoders); the flow families' T5 or Qwen encoder goes (:mod:`.flow`)."""

    def predict(
        self,
        models: Models,
        denoiser: torch.nn.Module,
        latents: torch.Tensor,
        noise: torch.Tensor,
        t: torch.Tensor,
        hidden: torch.Tensor,
        added: dict | None,
        channels_last: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the denoiser's prediction, its target) for these examples: the latents noised to timesteps ``t`` by
        the scheduler; the target ε or v as the scheduler's ``prediction_type`` says."""
        scheduler = models.noise_scheduler
        noisy = scheduler.add_noise(latents, noise, t)
        dtype = models.unet_dtype
        model_in = noisy.to(dtype)
        if added is not None:  # SDXL: the pooled text embedding and the micro-conditioning
            added = {k: v.to(dtype) for k, v in added.items()}
        if channels_last:
            model_in = model_in.contiguous(memory_format=torch.channels_last)
        with autocast(models.weight_dtype) if models.unet_autocast else contextlib.nullcontext():
            pred = denoiser(model_in, t, hidden.to(dtype), added_cond_kwargs=added, return_dict=False)[0]
        prediction_type = scheduler.config.prediction_type
        if prediction_type == "epsilon":
            return pred, noise
        if prediction_type == "v_prediction":
            return pred, scheduler.get_velocity(latents, noise, t)
        raise ConfigError(f"unsupported prediction type {prediction_type!r} in the model's scheduler")

    def loss(
        self,
        models: Models,
        pred: torch.Tensor,
        target: torch.Tensor,
        t: torch.Tensor,
        snr_gamma: float | None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The loss of these examples' predictions (min-SNR-γ weighted with ``snr_gamma``; ``mask`` [b, 1, h, w]:
        ``--masks``' latent masks, each example's errors weighted by its mask and normalised by its sum)."""
        scheduler = models.noise_scheduler
        return denoising_loss(
            pred,
            target,
            t,
            snr_gamma=snr_gamma,
            alphas_cumprod=scheduler.alphas_cumprod,
            prediction_type=scheduler.config.prediction_type,
            mask=mask,
        )
