"""FLUX.2 [klein] edit training on image pairs (``--cond_image_column``, as diffusers'
train_dreambooth_lora_flux2_klein_img2img.py): each training image is the edited result of its reference image,
named in metadata.jsonl, on the tiny pipeline under real mpirun:

* the reference's tokens follow the noisy ones with the position ids Flux2KleinPipeline gives ``image=`` (time 10),
  from the same normalised, patchified latents, and only the noisy tokens' prediction is kept;
* 2 ranks x batch 1 learn what 1 rank x batch 2 learns, with the held-out pairs' validation loss and a validation
  image made from a reference; a resume of the 2-rank run's step-2 checkpoint ends where the uninterrupted run ends;
* stock ``Flux2KleinPipeline.load_lora_weights`` loads the LoRA, the image changes, and it depends on the reference:
  another reference with the same prompt and seed gives another image;
* pairs are refused in one line where they cannot train: a family that takes no reference, prior preservation,
  a reference that is missing, outside the data, or itself a training image;
* with --buckets, each reference is in its training image's bucket.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from cli_runs import method_args, refused, train
from PIL import Image
from safetensors.torch import load_file
from test_flux2_train import pipe, tiny_flux2_model  # noqa: F401 - the fixtures
from test_methods import LORA_FILE, assert_same_training

PROMPT = "make the square blue"
# The pair runs' flags (shared with the other edit families' tests)
FLAGS = (
    "--cond_image_column=cond_image",
    "--rank=2",
    "--lora_alpha=4",
    "--learning_rate=1e-2",
    "--checkpointing_steps=2",
    f"--validation_prompt={PROMPT}",
    "--num_validation_images=1",
    "--validation_split=0.2",
    "--validation_steps=2",
)


def write_pairs(root: Path, n: int = 5) -> Path:
    """``n`` pairs (``xeonsd make-dataset --pairs``): a red square on black (the reference, in ref/) and the same
    square blue (the training image), captioned with the instruction PROMPT, in metadata.jsonl."""
    from xeonsd.assets import make_pairs

    return make_pairs(root, n, prompt=PROMPT)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_pairs(tmp_path_factory.mktemp("pairs") / "data")


def pair_runs(model: Path, pairs: Path, root: Path, flags: tuple[str, ...]):
    """``run(ranks, kind)``: the output dir of that run of ``model`` on ``pairs``, trained once: 4 steps of ``flags``
    on 1 rank x batch 2 or 2 ranks x batch 1; ``resume``: the 2-rank run's checkpoint-2 resumed on 1 rank x batch 2.
    (Shared with the other edit families' tests.)"""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done: dict[tuple, Path] = {}

    def run(ranks: int, kind: str = "short") -> Path:
        if (ranks, kind) not in done:
            out = root / f"{ranks}-{kind}"
            more = flags
            if kind == "resume":
                out.mkdir()
                shutil.copytree(run(2) / "checkpoint-2", out / "checkpoint-2")
                more += ("--resume_from_checkpoint=latest",)
            args = method_args("lora", model, pairs, out, *more, steps=4, batch=2 if ranks == 1 else 1)
            (root / f"{out.name}.log").write_text(train(args, env, ranks=ranks).stderr)
            done[(ranks, kind)] = out
        return done[(ranks, kind)]

    run.root = root  # type: ignore[attr-defined]
    return run


@pytest.fixture(scope="module")
def runs(tiny_flux2_model, pairs, tmp_path_factory):  # noqa: F811 - the imported fixture
    return pair_runs(tiny_flux2_model, pairs, tmp_path_factory.mktemp("flux2-edit-runs"), FLAGS)


def lora_b(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_file(str(path / LORA_FILE)).items() if "lora_B" in k}


@torch.no_grad()
def test_the_reference_joins_the_tokens_as_the_pipeline_passes_image(pipe):  # noqa: F811
    """The reference's latents (our latent cache's VAE view and affine) and ids against
    Flux2KleinPipeline.prepare_image_latents, the tokens of the call against the pipeline's concatenation, and the
    prediction of the noisy tokens only."""
    from xeonsd.families.flux2.training import TRAINING as FLUX2
    from xeonsd.families.flux2.training import pack

    g = torch.Generator().manual_seed(0)
    pixels = torch.rand(2, 3, 64, 64, generator=g) * 2 - 1
    shift, scaling = FLUX2.latent_affine(pipe.vae)
    ours = (FLUX2.latent_vae(pipe.vae).encode(pixels[1:]).latent_dist.mean - shift) * scaling
    theirs, their_ids = pipe.prepare_image_latents([pixels[1:]], 1, g, "cpu", torch.float32)
    assert torch.allclose(pack(ours), theirs, atol=1e-5)

    noisy = torch.randn(1, 128, 4, 4, generator=g)
    hidden = torch.randn(1, 8, pipe.transformer.config.joint_attention_dim, generator=g)
    sigmas = torch.tensor([0.5])
    kw = FLUX2.denoiser_kwargs(pipe.transformer.config, noisy, sigmas, hidden, None, {"references": (ours,)}, None)
    latent_ids = pipe._prepare_latent_ids(noisy)
    assert torch.allclose(kw["hidden_states"], torch.cat([pipe._pack_latents(noisy), theirs], dim=1), atol=1e-5)
    assert torch.equal(kw["img_ids"], torch.cat([latent_ids, their_ids], dim=1))
    out = pipe.transformer(**kw, return_dict=False)[0]
    assert out.shape[1] == 2 * 16  # the noisy tokens and the reference's
    assert torch.equal(FLUX2.unpack(out, noisy.shape), pipe._unpack_latents_with_ids(out[:, :16], latent_ids))
    plain = dict(kw, hidden_states=kw["hidden_states"][:, :16], img_ids=latent_ids)
    alone = pipe.transformer(**plain, return_dict=False)[0]
    assert (alone - out[:, :16]).abs().max() > 1e-4, "the reference does not reach the prediction"


def assert_pair_runs_agree(runs, family: str) -> None:
    """2 ranks x batch 1 trained what 1 rank x batch 2 trained, and so did the resumed run, with the held-out
    pairs' validation losses equal; the validation image is an edit of the first pair's reference, at
    --resolution. (Shared with the other edit families' tests.)"""
    one, two, resumed = runs(1), runs(2), runs(1, "resume")
    summary = json.loads((two / "train_summary.json").read_text())
    assert summary["family"] == family and summary["ranks"] == 2
    zero = {k: torch.zeros_like(v) for k, v in lora_b(one).items()}
    assert_same_training(lora_b(one), lora_b(two), zero)
    assert "resumed from" in (runs.root / f"{resumed.name}.log").read_text()
    assert_same_training(lora_b(one), lora_b(resumed), zero)
    with Image.open(one / "validation" / "final" / "00.png") as im:
        assert im.size == (64, 64)
    rows = [[json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (one, two)]
    val = [[r["val_loss"] for r in rs if "val_loss" in r] for rs in rows]  # the held-out pair, at fixed σ
    assert len(val[0]) == 2 and val[0] == pytest.approx(val[1], rel=1e-4)


def assert_edit_depends_on_the_reference(pipeline, out: Path, pairs: Path, image) -> None:
    """Stock diffusers' ``load_lora_weights`` loads the run's LoRA; ``image(pipe, reference)`` (the edit, a fixed
    seed) changes with it, and another reference gives another image. (Shared with the other edit families.)"""
    refs = [Image.open(pairs / "ref" / f"p{i}.png").convert("RGB") for i in (0, 4)]
    before = image(pipeline, refs[0])
    pipeline.load_lora_weights(str(out), weight_name=LORA_FILE, adapter_name="edit")
    try:
        after, other = image(pipeline, refs[0]), image(pipeline, refs[1])
    finally:
        pipeline.delete_adapters("edit")
    assert np.abs(after - before).max() > 1e-3, "the LoRA does not change the image"
    assert np.abs(after - other).max() > 1e-3, "another reference gives the same image"


def edit(pipeline, ref: Image.Image, **extra) -> np.ndarray:
    """The pipeline's edit of ``ref`` with the pairs' instruction: 4 steps at 64 px, seed 0."""
    kw = {"prompt": PROMPT, "num_inference_steps": 4, "height": 64, "width": 64, "output_type": "np"}
    return pipeline(image=ref, generator=torch.Generator().manual_seed(0), **kw, **extra).images[0]


def test_two_ranks_and_a_resume_learn_what_one_rank_with_double_batch_learns(runs):
    assert_pair_runs_agree(runs, "flux2")


def test_stock_diffusers_loads_the_lora_and_the_image_depends_on_the_reference(runs, pipe, pairs):  # noqa: F811
    assert_edit_depends_on_the_reference(pipe, runs(1), pairs, edit)


def test_pairs_are_refused_where_they_cannot_train(tmp_path, tiny_model, tiny_flux2_model, pairs):  # noqa: F811
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

    def refusal(model: Path, data: Path, *extra: str) -> str:
        args = method_args("lora", model, data, tmp_path / "out", "--cond_image_column=cond_image", *extra)
        return refused(args, env)

    err = refusal(tiny_model, pairs)
    assert "--cond_image_column: SD 1.x/2.x (StableDiffusionPipeline) takes no reference image" in err
    assert "FLUX.2 [klein]" in err
    assert "class images have no reference images" in refusal(
        tiny_flux2_model,
        pairs,
        "--with_prior_preservation",
        "--class_prompt=a square",
        "--num_class_images=1",
        f"--class_data_dir={tmp_path / 'class'}",
    )


def test_a_bad_reference_is_named_with_its_metadata_line(tmp_path, pairs):
    from xeonsd.trainer.captions import read_references
    from xeonsd.trainer.data import DataError, find_images

    images = find_images(pairs)
    found = read_references(pairs, images, "cond_image")
    assert [p.name for p in found] == [p.name for p in images]
    assert {len(refs) for refs in found.values()} == {1} and {r.parent.name for (r,) in found.values()} == {"ref"}
    listed = tmp_path / "listed"  # the field as a list: one or more references per image, 1 to what the model takes
    shutil.copytree(pairs, listed)
    rows = [json.loads(x) for x in (listed / "metadata.jsonl").read_text().splitlines()]
    for r in rows:
        r["cond_image"] = [r["cond_image"], "ref/p4.png"]
    (listed / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    two = read_references(listed, find_images(listed), "cond_image", most=3)
    assert [[r.name for r in refs] for refs in two.values()][:2] == [["p0.png", "p4.png"], ["p1.png", "p4.png"]]
    with pytest.raises(DataError, match="2 reference images for p0.png; this model takes at most 1"):
        read_references(listed, find_images(listed), "cond_image")
    for name, edit, expected in (
        ("missing", lambda r: r.pop("cond_image"), "no reference image for p0.png"),
        ("empty list", lambda r: r.update(cond_image=[]), "no reference image for p0.png"),
        ("outside", lambda r: r.update(cond_image="../elsewhere.png"), "is outside"),
        ("training", lambda r: r.update(cond_image="p1.png"), "is a training image"),
        ("absent", lambda r: r.update(cond_image="ref/none.png"), "cannot read the reference image"),
        ("uneven", lambda r: r.update(cond_image=["ref/p0.png", "ref/p1.png"]), "every training image needs the same"),
    ):
        data = tmp_path / name
        shutil.copytree(pairs, data)
        rows = [json.loads(x) for x in (data / "metadata.jsonl").read_text().splitlines()]
        edit(rows[0])
        (data / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        with pytest.raises(DataError) as err:
            read_references(data, find_images(data), "cond_image", most=3)
        line = 2 if name == "uneven" else 1  # p1's line: its one reference against p0's two
        assert expected in str(err.value) and f"metadata.jsonl:{line}" in str(err.value), err.value
    (tmp_path / "missing" / "metadata.jsonl").unlink()
    with pytest.raises(DataError, match="has no metadata.jsonl; edit training reads"):
        read_references(tmp_path / "missing", find_images(tmp_path / "missing"), "cond_image")


def test_pairs_of_mixed_aspect_train_in_buckets(tmp_path, tiny_flux2_model):  # noqa: F811
    """--buckets with pairs: each reference goes into its training image's bucket (landscape and portrait pairs,
    the reference of another size than its image), so a batch of one bucket stacks the references too."""
    from diffusers import AutoencoderKLFlux2

    from xeonsd.families.flux2.training import TRAINING as FLUX2
    from xeonsd.trainer.buckets import assign
    from xeonsd.trainer.latents import LatentTable

    data = tmp_path / "data"
    (data / "ref").mkdir(parents=True)
    rows = []
    for i, (w, h) in enumerate([(96, 64), (96, 64), (64, 96), (64, 96)]):
        a = np.zeros((h, w, 3), np.uint8)
        a[h // 4 : h // 2, w // 4 : w // 2] = (230, 30, 30)
        Image.fromarray(a).resize((w * 2, h * 2)).save(data / "ref" / f"p{i}.png")  # twice the size
        a[h // 4 : h // 2, w // 4 : w // 2] = (30, 30, 230)
        Image.fromarray(a).save(data / f"p{i}.png")
        rows.append({"file_name": f"p{i}.png", "text": PROMPT, "cond_image": f"ref/p{i}.png"})
    (data / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    images = sorted(data.glob("p*.png"))
    buckets = assign(images, 64, 48, 80, 16)
    assert len(set(buckets.of_image)) == 2  # a landscape and a portrait bucket
    cfg = SimpleNamespace(
        resolution=64, center_crop=True, latent_cache=True, latent_cache_dir=None, method="lora", random_flip=True
    )
    vae = AutoencoderKLFlux2.from_pretrained(tiny_flux2_model, subfolder="vae")
    models = SimpleNamespace(training=FLUX2, vae=vae, weight_dtype=torch.float32)
    refs = {p: (data / "ref" / p.name,) for p in images}
    table = LatentTable.build(cfg, models, images, 0, 0, 1, buckets, refs)
    for k in range(len(images)):  # an image's rows and its reference's: the image's bucket, mirrored alike
        assert table.mean[2 * k].shape == table.references[0].mean[2 * k].shape == table.mean[2 * k + 1].shape
    assert table.mean[0].shape != table.mean[4].shape
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    flags = ("--cond_image_column=cond_image", "--buckets", "--min_bucket_reso=48", "--max_bucket_reso=80")
    out = tmp_path / "out"
    train(method_args("lora", tiny_flux2_model, data, out, *flags, "--bucket_reso_steps=16", steps=2, batch=2), env)
    summary = json.loads((out / "train_summary.json").read_text())
    assert len(summary["buckets"]["buckets"]) == 2 and (out / LORA_FILE).is_file(), summary["buckets"]
