"""VAE latents of the training inputs: cached once, or encoded every step (the recipe's way, kept as baseline).

The VAE encoder maps an image to a diagonal Gaussian (mean, std); training samples ``mean + std * eps``. The
inputs never change during a run (each image and its mirror), so encoding them once and sampling the cached
distribution draws from exactly the same distribution as encoding every step, without the encoder's FLOPs. A run
that does not flip (:func:`xeonsd.trainer.data.flips`) and the validation set encode no mirror.

The cache is built in shards: each rank encodes every ``world``-th image (the image and its mirror, so each image
is decoded on one rank, one at a time: no rank holds the decoded set) and one all-reduce gives every rank all of
them; with aspect-ratio buckets, one shard and all-reduce per bucket size. With ``--latent_cache_dir`` it is also kept on disk between runs, one file per image keyed by the
image's bytes, the VAE, the resolution and the crop, so a second run (or a rank on another node that has the
files) encodes nothing. For SDXL each input also has its micro-conditioning (``time_ids``: original size, crop,
target size; :func:`xeonsd.families.sdxl.training.time_ids_for`), which is part of the key and stored in the file.
``--masks``' latent masks (:mod:`.masks`) sit beside the latents in the table, made from their files at start-up:
neither in the disk cache's files nor in its key.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from xeonsd.cluster.distributed import all_reduce_sum_
from xeonsd.families import vae_scale
from xeonsd.fsutil import atomic_path
from xeonsd.trainer.buckets import Buckets, Placement, image_size, placement

log = logging.getLogger(__name__)


@torch.no_grad()
def encode_distribution(
    vae: torch.nn.Module, pixels: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the VAE's latent distribution for ``pixels`` [n, 3, H, W], returned in float32."""
    dist = vae.encode(pixels.to(dtype)).latent_dist
    return dist.mean.float(), dist.std.float()


# Inputs per VAE call while the cache is built. Measured (SD 1.5 VAE, 512 px, bf16 on AMX, interleaved, CPU
# seconds): one call of 2 inputs costs 1.00-1.07x two calls of 1; the encoder is compute-bound, batching gains nothing.
ENCODE_BATCH = 1


@torch.no_grad()
def build_latent_cache(
    vae: torch.nn.Module,
    count: int,
    load: Callable[[int], torch.Tensor],
    dtype: torch.dtype,
    latent_shape: tuple[int, int, int],
    rank: int,
    world_size: int,
    todo: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode the inputs ``todo`` (default: all ``count``; ``load(i)`` gives input i as [1, 3, H, W]) once: each
    rank encodes its share (:func:`my_share`), ``ENCODE_BATCH`` to a VAE call, and the results are summed
    across ranks, so the cache costs about ``len(todo) / ranks`` encodes per rank. Rows not in ``todo`` stay
    zero."""
    todo = list(range(count)) if todo is None else list(todo)
    packed = torch.zeros((2, count, *latent_shape), dtype=torch.float32)
    mine = my_share(todo, rank, world_size)
    for k in range(0, len(mine), ENCODE_BATCH):
        rows = mine[k : k + ENCODE_BATCH]
        m, s = encode_distribution(vae, torch.cat([load(i) for i in rows]), dtype)
        packed[0, rows], packed[1, rows] = m, s
    all_reduce_sum_(packed, world_size)
    return packed[0], packed[1]


def my_share(todo: Sequence[int], rank: int, world_size: int) -> list[int]:
    """The inputs of ``todo`` this rank encodes: those of every ``world_size``-th image (input ``2*i`` is image i,
    ``2*i+1`` its mirror), so that each image is decoded on one rank only."""
    return [i for i in todo if (i // 2) % world_size == rank]


def build_bucketed_cache(
    vae: torch.nn.Module,
    load: Callable[[int], torch.Tensor],
    dtype: torch.dtype,
    shapes: Sequence[tuple[int, int, int]],
    rank: int,
    world_size: int,
    todo: Sequence[int] | None = None,
) -> tuple[torch.Tensor | list[torch.Tensor], torch.Tensor | list[torch.Tensor], int]:
    """:func:`build_latent_cache` for inputs of several latent shapes (``shapes``: one per input; aspect-ratio
    buckets), one shape at a time, each shared out over the ranks. Returns (mean, std, encodes on this rank): one
    tensor each when every input has the same shape, else a list with a tensor per input."""
    count = len(shapes)
    todo = list(range(count)) if todo is None else list(todo)
    distinct = sorted(set(shapes))
    if len(distinct) == 1:
        mean, std = build_latent_cache(vae, count, load, dtype, distinct[0], rank, world_size, todo)
        return mean, std, len(my_share(todo, rank, world_size))
    wanted = set(todo)
    means: list[torch.Tensor] = [torch.empty(0)] * count
    stds: list[torch.Tensor] = [torch.empty(0)] * count
    encoded = 0
    for shape in distinct:
        rows = [i for i, s in enumerate(shapes) if s == shape]  # an image's two inputs stay neighbours
        sub = [j for j, i in enumerate(rows) if i in wanted]
        m, sd = build_latent_cache(
            vae, len(rows), lambda j, rows=rows: load(rows[j]), dtype, shape, rank, world_size, sub
        )
        encoded += len(my_share(sub, rank, world_size))
        for j, i in enumerate(rows):
            means[i], stds[i] = m[j], sd[j]
    return means, stds, encoded


def sample_latents(
    mean: torch.Tensor, std: torch.Tensor, eps: torch.Tensor, scaling_factor: float, shift_factor: float = 0.0
) -> torch.Tensor:
    """Scaled latents drawn from N(mean, std^2) with the given standard-normal ``eps``: (z - shift) * scale, the
    shift of the flow models' VAEs (FLUX.1, SD3; 0 for SD's)."""
    return (mean + std * eps - shift_factor) * scaling_factor


def image_cache_key(
    image: Path,
    vae_key: str,
    resolution: int,
    center_crop: bool,
    time_ids: torch.Tensor | None = None,
    bucket: tuple[int, int] | None = None,
) -> str:
    """The disk cache's name for one image's (and its mirror's) latent distribution (and SDXL's time ids); with
    aspect-ratio buckets, the image's bucket (width, height) is part of it."""
    h = hashlib.sha256(Path(image).read_bytes())
    h.update(f"\0{vae_key}\0{resolution}\0{int(center_crop)}".encode())
    if bucket is not None:
        h.update(f"\0bucket:{bucket[0]}x{bucket[1]}".encode())
    if time_ids is not None:
        h.update(("\0time_ids:" + ",".join(f"{v:g}" for v in time_ids.flatten().tolist())).encode())
    return h.hexdigest()[:32]


@dataclass
class LatentTable:
    """The latent distribution of every training input (row ``2*i`` image i, ``2*i+1`` its mirror), or the VAE and
    the pixels to encode them every step (``--no-latent_cache``); with ``--cond_image_column``, ``references``: one
    such table per reference image (an image's first, its second, …), row for row (a mirrored example sees its
    references mirrored)."""

    shape: tuple[int, int, int]
    count: int
    scaling: float | torch.Tensor  # latents = (z - shift) * scaling (TrainFamily.latent_affine; [c, 1, 1] or a float)
    shift: float | torch.Tensor = 0.0  # the VAE's shift_factor (FLUX.1, SD3)
    # [count, ...] each; with buckets of several sizes, a list of one tensor per input row
    mean: torch.Tensor | list[torch.Tensor] | None = None
    std: torch.Tensor | list[torch.Tensor] | None = None
    vae: torch.nn.Module | None = None
    pixels: torch.Tensor | list[torch.Tensor] | None = None
    dtype: torch.dtype = torch.float32
    time_ids: torch.Tensor | None = None  # SDXL: [count, 6] micro-conditioning per input row
    encoded: int = 0  # inputs the VAE encoded for the cache (all ranks)
    # False: the mirror rows (2*i+1) were never encoded (a run that does not flip; the validation set): zeros
    mirrors: bool = True
    references: list[LatentTable] | None = None
    # --masks: each row's latent mask [1, h, w] (:mod:`.masks`; made from the files at start-up, never cached on
    # disk), stacked [count, 1, h, w] or, with buckets of several sizes, a list; None: unmasked
    mask: torch.Tensor | list[torch.Tensor] | None = None

    @property
    def inputs(self) -> int:
        """The rows a run samples: every image, and its mirror where the run flips."""
        return self.count if self.mirrors else self.count // 2

    def mask_of(self, examples) -> torch.Tensor | None:
        """The examples' latent masks [b, 1, h, w] (``--masks``), or None."""
        if self.mask is None:
            return None
        return torch.stack([self.mask[e.input_id] for e in examples])

    def time_ids_of(self, examples) -> torch.Tensor:
        assert self.time_ids is not None, "time ids exist for SDXL models only"
        return self.time_ids[[e.input_id for e in examples]]

    def sample(self, examples) -> torch.Tensor:
        rows = [e.input_id for e in examples]
        if self.mean is not None:  # a batch comes from one bucket: its rows have one shape
            mean, std = torch.stack([self.mean[r] for r in rows]), torch.stack([self.std[r] for r in rows])
        else:
            mean, std = encode_distribution(self.vae, torch.stack([self.pixels[r] for r in rows]), self.dtype)
        eps = torch.stack([e.latent_eps for e in examples])
        return sample_latents(mean, std, eps, self.scaling, self.shift)

    @classmethod
    def build(
        cls,
        cfg,
        models,
        images: list[Path],
        rank: int,
        local_rank: int,
        world: int,
        buckets: Buckets | None = None,
        references: dict[Path, tuple[Path, ...]] | None = None,
        masks: dict[Path, Path] | None = None,
        mirrors: bool | None = None,
    ) -> LatentTable:
        """The table of ``images`` at ``--resolution`` or, with ``buckets``, each in its bucket; from the disk
        cache where every rank has an image's file. ``references``: each image's reference images (edit training),
        whose tables (one per place in the list) are built the same way and kept in ``references``: a reference
        goes into its training image's bucket (resized and cropped by the same rule), so a batch stacks both.
        ``masks``: each image's mask file (``--masks``), whose latent masks the table keeps (``mask``).
        ``mirrors``: whether the mirror rows are encoded too (default: where the run flips,
        :func:`~xeonsd.trainer.data.flips`); without, they stay zero and no example samples them."""
        from xeonsd.trainer.data import flips

        mirrors = flips(cfg) if mirrors is None else mirrors
        table = cls._build(cfg, models, images, rank, local_rank, world, mirrors, buckets, masks)
        if references is not None and images:
            table.references = [
                cls._build(cfg, models, [references[p][k] for p in images], rank, local_rank, world, mirrors, buckets)
                for k in range(len(references[images[0]]))
            ]
        return table

    @classmethod
    def _build(
        cls,
        cfg,
        models,
        images: list[Path],
        rank: int,
        local_rank: int,
        world: int,
        mirrors: bool,
        buckets: Buckets | None = None,
        masks: dict[Path, Path] | None = None,
    ) -> LatentTable:
        from xeonsd.trainer.data import load_all_pixels, load_pixels
        from xeonsd.trainer.masks import mask_rows

        family = models.training
        vae = family.latent_vae(models.vae)
        scale = vae_scale(vae.config)
        shape = family.latent_dims(vae.config, scale, cfg.resolution, cfg.resolution)
        count = 2 * len(images)
        places = bucket_placements(images, buckets, cfg.center_crop)
        shapes = [shape] * count
        if places is not None:
            shapes = [family.latent_dims(vae.config, scale, p.bucket[1], p.bucket[0]) for p in places for _ in (0, 1)]
        shift, scaling = family.latent_affine(models.vae)
        # SDXL: each image's micro-conditioning, kept with its latents
        per_image = [
            family.time_ids(p, cfg.resolution, cfg.center_crop, places[k] if places else None)
            for k, p in enumerate(images)
        ]
        time_ids = torch.cat(per_image) if images and all(t is not None for t in per_image) else None
        common = {
            "shape": shape,
            "count": count,
            "scaling": scaling,
            "shift": shift,
            "dtype": models.weight_dtype,
            "time_ids": time_ids,
            "mirrors": mirrors,
        }
        if masks is not None:
            common["mask"] = mask_rows([masks[p] for p in images], cfg.resolution, cfg.center_crop, places, shapes)
        if not cfg.latent_cache:
            pixels = load_all_pixels(images, cfg.resolution, cfg.center_crop, cfg.dataloader_num_workers, places)
            return cls(**common, vae=vae, pixels=pixels)

        @functools.lru_cache(maxsize=1)  # an image and its mirror are consecutive inputs: one decode for both
        def pair(image: int) -> tuple[torch.Tensor, torch.Tensor]:
            return load_pixels(images[image], cfg.resolution, cfg.center_crop, places[image] if places else None)

        def load(i: int) -> torch.Tensor:
            return pair(i // 2)[i % 2].unsqueeze(0)

        needed = [i for i in range(count) if mirrors or i % 2 == 0]
        cache_dir = Path(cfg.latent_cache_dir).expanduser() if cfg.latent_cache_dir else None
        if cache_dir is None:
            mean, std, _ = build_bucketed_cache(vae, load, models.weight_dtype, shapes, rank, world, needed)
            return cls(**common, mean=mean, std=std, encoded=len(needed))

        files = _cache_files(cfg, models, cache_dir, images, time_ids, places)
        have = torch.tensor([int(cached_rows(f) >= (2 if mirrors else 1)) for f in files], dtype=torch.int64)
        everywhere = all_reduce_sum_(have.clone(), world)  # an image is reused only where every rank has it
        todo = [i for i in needed if everywhere[i // 2] < world]
        mean, std, here = build_bucketed_cache(vae, load, models.weight_dtype, shapes, rank, world, todo)
        sync_disk_cache(files, have, everywhere == world, mean, std, time_ids, local_rank == 0, mirrors)
        log.info(
            "latent cache %s: %d of %d image(s) reused, %d encoded (%d input(s) on this rank)",
            cache_dir,
            len(images) - len({i // 2 for i in todo}),
            len(images),
            len({i // 2 for i in todo}),
            here,
        )
        return cls(**common, mean=mean, std=std, encoded=len(todo))


def _cache_files(cfg, models, cache_dir: Path, images: list[Path], time_ids, places) -> list[Path]:
    """Each image's file in the disk cache ``cache_dir`` (:func:`image_cache_key`: its bytes, the VAE and the
    training dtype, the resolution and crop, SDXL's time ids, the bucket)."""
    from xeonsd.modelfiles.modelsource import model_fingerprint

    vae_key = model_fingerprint(cfg.pretrained_model_name_or_path, cfg.revision, subfolder="vae")
    vae_key += str(models.weight_dtype)
    keys = [
        image_cache_key(
            p,
            vae_key,
            cfg.resolution,
            cfg.center_crop,
            time_ids[2 * k : 2 * k + 2] if time_ids is not None else None,
            places[k].bucket if places else None,
        )
        for k, p in enumerate(images)
    ]
    return [cache_dir / f"{k}.safetensors" for k in keys]


def bucket_placements(images: list[Path], buckets: Buckets | None, center_crop: bool) -> list[Placement] | None:
    """How each image goes into its bucket (None without buckets); the sizes come from the image headers."""
    if buckets is None:
        return None
    return [placement(image_size(p), buckets.size_of(k), center_crop) for k, p in enumerate(images)]


def cached_rows(f: Path) -> int:
    """The rows an image's cache file holds: 2 (the image and its mirror), 1 (the image: written by a run that did
    not flip), 0 (no file)."""
    if not f.is_file():
        return 0
    with safe_open(str(f), "pt") as saved:
        return saved.get_slice("mean").get_shape()[0]


def sync_disk_cache(files, have, everywhere, mean, std, time_ids, writer: bool, mirrors: bool = True) -> None:
    """Fill the rows of the images every rank has (``everywhere``) from their files; a ``writer`` (one rank per
    node) writes the files its node lacks (``have``) from the freshly encoded rows (a file: an image's row, and its
    mirror's where the run encoded it; a run that flips rewrites a file without the mirror)."""
    rows = 2 if mirrors else 1
    for k, f in enumerate(files):
        if everywhere[k]:
            saved = load_file(str(f))
            mean[2 * k : 2 * k + rows] = saved["mean"][:rows]
            std[2 * k : 2 * k + rows] = saved["std"][:rows]
            if time_ids is not None:
                time_ids[2 * k : 2 * k + 2] = saved["time_ids"]
        elif writer and not have[k]:
            entry = {
                "mean": torch.stack([mean[2 * k + j] for j in range(rows)]),
                "std": torch.stack([std[2 * k + j] for j in range(rows)]),
            }
            if time_ids is not None:
                entry["time_ids"] = time_ids[2 * k : 2 * k + 2].contiguous()
            with atomic_path(f) as tmp:
                save_file(entry, str(tmp))
