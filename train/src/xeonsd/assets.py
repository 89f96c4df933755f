"""Offline assets built from code: a Stable Diffusion pipeline with random weights and a small image set.

Nothing can be downloaded in tests, so these stand in for the Hub model and the dicoo images:

* ``tiny``: a pipeline small enough to train in seconds, with the same structure as SD 1.x (4-level VAE with
  scale factor 8, cross-attention UNet, CLIP text encoder) and a tokenizer that knows the recipe's
  initializer word ``toy`` as one token.
* ``tiny-v``: the tiny pipeline in the SD 2.x style (v-prediction, linear attention projections, per-level
  head dims, GELU text encoder), for the tests of SD 2.x training.
* ``sd15``: the full SD 1.5 architecture (UNet ~860M parameters, 49,408-token vocabulary, VAE, CLIP-L text
  encoder) with random weights: the same FLOPs and memory as the real model, for realistic benchmarks.
* ``sd21``: the full SD 2.1 (768-v) architecture (UNet ~865M parameters, OpenCLIP-H-sized text encoder,
  v-prediction) with random weights, for benchmarks.

The image set can come with captions in each layout the trainer reads (see :mod:`xeonsd.trainer.captions`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from xeonsd.fsutil import atomic_dir

log = logging.getLogger(__name__)

# Words the tiny tokenizer knows as single tokens: the training templates, the recipe's prompts and
# initializer ("toy"), and a few common words for tests.
_WORDS = [
    "toy",
    "a",
    "an",
    "the",
    "of",
    "photo",
    "rendering",
    "cropped",
    "clean",
    "dark",
    "bright",
    "good",
    "close-up",
    "rendition",
    "nice",
    "small",
    "weird",
    "large",
    "cool",
    "painting",
    "picture",
    "in",
    "style",
    "by",
    "artwork",
    "yellow",
    "robot",
    "at",
    "beach",
    "high",
    "quality",
    "dog",
    "cat",
    "red",
    "blue",
    "green",
    "on",
    "with",
    "and",
    ",",
    ".",
    "drawing",
    "image",
    "object",
    "thing",
]

_BOS, _EOS = "<|startoftext|>", "<|endoftext|>"


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-to-printable-character table of GPT-2/CLIP byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def build_clip_vocab(words: list[str], vocab_size: int | None = None) -> tuple[dict[str, int], list[str]]:
    """A CLIP-style byte-level BPE vocabulary in which every word of ``words`` is one token.

    ``toy`` gets the first merges, so it is always a single token whatever else is in the vocabulary.
    With ``vocab_size`` the vocabulary is padded with unreachable filler tokens up to that size (the real
    CLIP vocabulary has 49,408 entries; what matters for a benchmark is the size of the embedding matrix).
    """
    chars = list(_bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars]
    merges: list[str] = []
    seen = set(tokens)
    ordered = ["toy"] + [w for w in words if w != "toy"]
    for word in ordered:
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        current = pieces[0]
        for piece in pieces[1:]:
            merged = current + piece
            if merged not in seen:
                merges.append(f"{current} {piece}")
                tokens.append(merged)
                seen.add(merged)
            current = merged
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if vocab_size is not None:
        filler = 0
        while len(vocab) < vocab_size - 2:
            vocab[f"<|filler{filler}|></w>"] = len(vocab)
            filler += 1
    vocab[_BOS] = len(vocab)
    vocab[_EOS] = len(vocab)
    return vocab, merges


@dataclass(frozen=True)
class Arch:
    """Dimensions of a generated pipeline."""

    unet_channels: tuple[int, ...]
    unet_layers: int
    unet_heads: int | tuple[int, ...]
    unet_down: tuple[str, ...]
    unet_up: tuple[str, ...]
    sample_size: int
    vae_channels: tuple[int, ...]
    vae_layers: int
    text_hidden: int
    text_layers: int
    text_heads: int
    text_intermediate: int
    vocab_size: int | None
    norm_groups: int
    prediction_type: str = "epsilon"
    linear_projection: bool = False
    text_act: str = "quick_gelu"


ARCHS: dict[str, Arch] = {
    "tiny": Arch(
        unet_channels=(32, 64),
        unet_layers=1,
        unet_heads=2,
        unet_down=("CrossAttnDownBlock2D", "DownBlock2D"),
        unet_up=("UpBlock2D", "CrossAttnUpBlock2D"),
        sample_size=8,
        vae_channels=(8, 8, 16, 16),
        vae_layers=1,
        text_hidden=32,
        text_layers=2,
        text_heads=4,
        text_intermediate=64,
        vocab_size=None,
        norm_groups=8,
    ),
    "sd15": Arch(
        unet_channels=(320, 640, 1280, 1280),
        unet_layers=2,
        unet_heads=8,
        unet_down=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        unet_up=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        sample_size=64,
        vae_channels=(128, 256, 512, 512),
        vae_layers=2,
        text_hidden=768,
        text_layers=12,
        text_heads=12,
        text_intermediate=3072,
        vocab_size=49408,
        norm_groups=32,
    ),
}
ARCHS["sd21"] = dataclasses.replace(
    ARCHS["sd15"],
    unet_heads=(5, 10, 20, 20),
    sample_size=96,
    text_hidden=1024,
    text_layers=23,
    text_heads=16,
    text_intermediate=4096,
    prediction_type="v_prediction",
    linear_projection=True,
    text_act="gelu",
)
ARCHS["tiny-v"] = dataclasses.replace(
    ARCHS["tiny"], unet_heads=(2, 4), prediction_type="v_prediction", linear_projection=True, text_act="gelu"
)


def make_tiny_model(out: Path, arch: str = "tiny", seed: int = 0) -> Path:
    """Write a random-weight ``StableDiffusionPipeline`` directory of the given architecture to ``out``."""
    import torch
    from diffusers import StableDiffusionPipeline

    if arch not in ARCHS:
        raise ValueError(f"unknown --arch {arch!r}; choose one of {sorted(ARCHS)}")
    a = ARCHS[arch]
    out = Path(out)
    torch.manual_seed(seed)
    # Built in this order from one seed: the weights depend on it.
    unet = _unet(a)
    vae = _vae(a)
    vocab, merges = build_clip_vocab(list(_WORDS), a.vocab_size)
    text_encoder = _text_encoder(a, vocab)
    scheduler = _scheduler(a)

    with atomic_dir(out) as tmp:
        pipe = StableDiffusionPipeline(
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=_tokenizer(tmp / "_tok_src", vocab, merges),
            unet=unet,
            scheduler=scheduler,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
        pipe.save_pretrained(tmp, safe_serialization=True)
        shutil.rmtree(tmp / "_tok_src")
    n_unet = sum(p.numel() for p in unet.parameters())
    log.info("wrote %s pipeline to %s (UNet %.1fM parameters, vocab %d)", arch, out, n_unet / 1e6, len(vocab))
    return out


def _unet(a: Arch) -> Any:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=a.sample_size,
        in_channels=4,
        out_channels=4,
        block_out_channels=a.unet_channels,
        layers_per_block=a.unet_layers,
        down_block_types=a.unet_down,
        up_block_types=a.unet_up,
        cross_attention_dim=a.text_hidden,
        attention_head_dim=a.unet_heads,
        norm_num_groups=a.norm_groups,
        use_linear_projection=a.linear_projection,
    )


def _vae(a: Arch) -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(a.vae_channels),
        up_block_types=("UpDecoderBlock2D",) * len(a.vae_channels),
        block_out_channels=a.vae_channels,
        layers_per_block=a.vae_layers,
        latent_channels=4,
        norm_num_groups=a.norm_groups,
        sample_size=a.sample_size * 8,
        scaling_factor=0.18215,
    )


def _text_encoder(a: Arch, vocab: dict[str, int]) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel

    text_config = CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=a.text_hidden,
        intermediate_size=a.text_intermediate,
        num_hidden_layers=a.text_layers,
        num_attention_heads=a.text_heads,
        max_position_embeddings=77,
        hidden_act=a.text_act,
        projection_dim=a.text_hidden,
        bos_token_id=vocab[_BOS],
        eos_token_id=vocab[_EOS],
        pad_token_id=vocab[_EOS],
    )
    return CLIPTextModel(text_config)


def _scheduler(a: Arch) -> Any:
    from diffusers import DDPMScheduler, PNDMScheduler

    scheduler = PNDMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type=a.prediction_type,
        skip_prk_steps=True,
        steps_offset=1,
    )
    # The training scheduler reads the same config; make sure it is a valid DDPM config too.
    DDPMScheduler.from_config(scheduler.config)
    return scheduler


def _tokenizer(src: Path, vocab: dict[str, int], merges: list[str]) -> Any:
    """A CLIP tokenizer of ``vocab`` and ``merges``, read from the files it is written to in SRC."""
    from transformers import CLIPTokenizer

    src.mkdir()
    (src / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (src / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return CLIPTokenizer(str(src / "vocab.json"), str(src / "merges.txt"), model_max_length=77, pad_token=_EOS)


CAPTION_LAYOUTS = ("metadata", "sidecar", "txt")
_COLOURS = ("red", "green", "blue")


def make_dataset(
    out: Path, count: int = 5, size: int = 128, seed: int = 0, captions: str | None = None, token: str = "<dicoo>"
) -> list[Path]:
    """Write ``count`` synthetic pictures of one small object (a yellow toy robot) in different poses.

    With ``captions`` (``metadata``: metadata.jsonl, ``sidecar``: a .txt beside each image, ``txt``:
    captions.txt), each image gets a caption that names the concept's ``token`` and the background's colour,
    e.g. ``a photo of a <dicoo> on a red background``."""
    if count < 1:
        raise ValueError("make-dataset needs --count >= 1")
    if captions is not None and captions not in CAPTION_LAYOUTS:
        raise ValueError(f"unknown --captions {captions!r}; choose one of {', '.join(CAPTION_LAYOUTS)}")
    rng = np.random.default_rng(seed)
    out = Path(out)
    paths = []
    texts = []
    with atomic_dir(out) as tmp:
        for i in range(count):
            bg = tuple(int(v) for v in rng.integers(40, 200, size=3))
            img = Image.new("RGB", (size, size), bg)
            d = ImageDraw.Draw(img)
            s = size / 128
            cx = size / 2 + rng.uniform(-12, 12) * s
            cy = size / 2 + rng.uniform(-8, 8) * s
            angle = rng.uniform(-0.4, 0.4)
            w, h = 44 * s, 50 * s
            body = [
                (
                    cx + dx * math.cos(angle) - dy * math.sin(angle),
                    cy + dx * math.sin(angle) + dy * math.cos(angle),
                )
                for dx, dy in ((-w / 2, -h / 2), (w / 2, -h / 2), (w / 2, h / 2), (-w / 2, h / 2))
            ]
            d.polygon(body, fill=(235, 200, 40), outline=(40, 40, 40))
            head_r = 14 * s
            hx, hy = cx + math.sin(angle) * h * 0.8, cy - math.cos(angle) * h * 0.8
            d.ellipse(
                [hx - head_r, hy - head_r, hx + head_r, hy + head_r],
                fill=(245, 215, 60),
                outline=(40, 40, 40),
            )
            for ex in (-5, 5):
                d.ellipse([hx + ex * s - 2 * s, hy - 2 * s, hx + ex * s + 2 * s, hy + 2 * s], fill=(20, 20, 20))
            name = f"dicoo_{i:02d}.png"
            img.save(tmp / name)
            paths.append(out / name)
            texts.append(f"a photo of a {token} on a {_COLOURS[int(np.argmax(bg))]} background")
        if captions == "metadata":
            lines = [json.dumps({"file_name": p.name, "text": t}) for p, t in zip(paths, texts, strict=True)]
            (tmp / "metadata.jsonl").write_text("\n".join(lines) + "\n")
        elif captions == "sidecar":
            for p, t in zip(paths, texts, strict=True):
                (tmp / p.with_suffix(".txt").name).write_text(t + "\n")
        elif captions == "txt":
            (tmp / "captions.txt").write_text("\n".join(texts) + "\n")
    log.info("wrote %d images to %s%s", count, out, f" with captions ({captions})" if captions else "")
    return paths
