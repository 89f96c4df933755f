"""Qwen-Image-Edit-2511 (``families/qwenimage_edit/``) on its tiny pipeline (``make-tiny-model --arch
tiny-qwenimage-edit``: Qwen-Image's tiny structure with 2511's ``zero_cond_t`` transformer in a
``QwenImageEditPlusPipeline``), trained on image pairs under real mpirun:

* it is told from Qwen-Image by the pipeline's class, and a pipeline without its processor is refused;
* a prompt table row is what the pipeline's own ``encode_prompt`` gives for the instruction and its reference
  images (Qwen2.5-VL's vision tower included; our processor expands the image tokens as Qwen2VLProcessor does);
* the references' tokens follow the noisy ones, ``img_shapes`` lists them after the target, both reach the
  prediction, and only the noisy tokens' prediction is kept;
* 2 ranks x batch 1 learn what 1 rank x batch 2 learns, with the held-out pairs' validation loss and a validation
  image made from the first pair's reference; a resume of the 2-rank run's checkpoint ends where the uninterrupted
  run ends;
* stock ``QwenImageEditPlusPipeline.load_lora_weights`` loads the LoRA, the image changes and depends on the
  reference;
* two references per image train; what cannot is refused in one line: no pairs, more references than the pipeline
  takes, caption draws;
* the learning proof: trained on the pairs, the edit of a reference lands nearer its pair's edited image.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from cli_runs import method_args, refused, train
from PIL import Image
from test_flux2_edit_train import (
    FLAGS,
    PROMPT,
    assert_edit_depends_on_the_reference,
    assert_pair_runs_agree,
    edit,
    pair_runs,
    write_pairs,
)
from test_methods import LORA_FILE

ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
# The learning proof's LoRA (Qwen-Image's: test_qwenimage_train.py) and margin: trained on the pairs, the edit of a
# reference lands at most this fraction of the base model's distance from that pair's edited image (measured 0.81
# on Zen 4; with the loss's target flipped, x0 - eps, the test fails).
LEARN = ("--cond_image_column=cond_image", "--rank=16", "--learning_rate=1e-2", "--checkpointing_steps=0")
MARGIN = 0.90


@pytest.fixture(scope="module")
def edit_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from xeonsd.assets import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("assets") / "tiny-qwenimage-edit", arch="tiny-qwenimage-edit")


@pytest.fixture(scope="module")
def pipe(edit_model):
    from diffusers import QwenImageEditPlusPipeline

    from xeonsd.families.qwenimage_edit.processor import VisionProcessor

    p = QwenImageEditPlusPipeline.from_pretrained(edit_model, processor=VisionProcessor.from_pretrained(edit_model))
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_pairs(tmp_path_factory.mktemp("qwen-edit-pairs") / "data")


@pytest.fixture(scope="module")
def runs(edit_model, pairs, tmp_path_factory):
    return pair_runs(edit_model, pairs, tmp_path_factory.mktemp("qwen-edit-runs"), FLAGS)


@pytest.fixture(scope="module")
def learned(edit_model, pairs, tmp_path_factory) -> Path:
    from test_qwenimage_train import LEARN_LAYERS

    out = tmp_path_factory.mktemp("qwen-edit-learn") / "out"
    train(method_args("lora", edit_model, pairs, out, *LEARN, f"--lora_layers={LEARN_LAYERS}", steps=30, batch=4), ENV)
    return out


def test_the_edit_model_is_told_from_qwen_image_by_its_pipeline(edit_model, tmp_path):
    from xeonsd.families import FamilyError, by_name, detect_family

    found = detect_family(edit_model)
    assert found.spec is by_name("qwenimage_edit") and found.spec.denoiser_class == "QwenImageTransformer2DModel"
    index = json.loads((edit_model / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPlusPipeline" and index["processor"][1] == "Qwen2VLProcessor"
    no_processor = tmp_path / "no-processor"
    no_processor.mkdir()
    (no_processor / "model_index.json").write_text(json.dumps({k: v for k, v in index.items() if k != "processor"}))
    for part in ("transformer", "vae"):
        shutil.copytree(edit_model / part, no_processor / part)
    with pytest.raises(FamilyError, match="a Qwen-Image-Edit-2511 pipeline without processor"):
        detect_family(no_processor)


@torch.no_grad()
def test_a_prompt_row_is_the_pipelines_encoding_of_the_instruction_and_its_references(pipe, pairs):
    """Our table (the instruction with each reference through Qwen2.5-VL, encoded alone) against
    QwenImageEditPlusPipeline.encode_prompt with the same condition images, for one and for two references."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions

    from xeonsd.families import by_name
    from xeonsd.families.qwenimage_edit.training import QwenEditPromptConditioning
    from xeonsd.trainer.prompt_tables import PromptTable

    spec = by_name("qwenimage_edit")
    refs = [pairs / "ref" / "p0.png", pairs / "ref" / "p3.png"]
    models = SimpleNamespace(
        tokenizer=pipe.tokenizer,
        text_encoder=pipe.text_encoder,
        processor=pipe.processor,
        text_length=1024,
        weight_dtype=torch.float32,
        family=SimpleNamespace(label=spec.label),
        text_pending={},
    )
    table = PromptTable((PROMPT, "turn it around"), True, "test", ((refs[0],), tuple(refs)))
    ours = QwenEditPromptConditioning(models, table, trainable=False, rank=0, world=1)
    for row, n in ((0, 1), (1, 2)):
        images = []
        for path in refs[:n]:
            with Image.open(path) as im:
                im = im.convert("RGB")
                w, h = calculate_dimensions(CONDITION_IMAGE_SIZE, im.size[0] / im.size[1])
                images.append(pipe.image_processor.resize(im, h, w))
        theirs, _ = pipe.encode_prompt(prompt=table.texts[row], image=images, device="cpu")
        hidden, mask = ours.encode([row])
        assert hidden.shape == theirs.shape and bool(mask.all()), (hidden.shape, theirs.shape)
        torch.testing.assert_close(hidden, theirs, rtol=1e-4, atol=1e-5)
    one, two = ours.encode([0])[0], ours.encode([1])[0]
    assert two.shape[1] > one.shape[1]  # the second picture's vision tokens


@torch.no_grad()
def test_the_references_join_the_tokens_as_the_pipeline_passes_image(pipe):
    from xeonsd.families.flow import pack
    from xeonsd.families.qwenimage_edit.training import TRAINING as EDIT

    g = torch.Generator().manual_seed(0)
    noisy = torch.randn(1, 16, 8, 8, generator=g)
    refs = tuple(torch.randn(1, 16, 8, 8, generator=g) for _ in range(2))
    hidden = torch.randn(1, 12, pipe.transformer.config.joint_attention_dim, generator=g)
    config = pipe.transformer.config
    flow = SimpleNamespace(guidance=1.0)
    kw = EDIT.denoiser_kwargs(config, noisy, torch.tensor([0.5]), hidden, None, {"references": refs}, flow)
    assert torch.equal(kw["hidden_states"], torch.cat([pack(noisy), *map(pack, refs)], dim=1))
    assert kw["img_shapes"] == [[(1, 4, 4), (1, 4, 4), (1, 4, 4)]]  # the pipeline's: the target's, then each one's
    out = pipe.transformer(**kw, return_dict=False)[0]
    assert out.shape[1] == 48
    assert torch.equal(EDIT.unpack(out, noisy.shape), pipe._unpack_latents(out[:, :16], 64, 64, 8)[:, :, 0])
    swapped = EDIT.denoiser_kwargs(config, noisy, torch.tensor([0.5]), hidden, None, {"references": refs[::-1]}, flow)
    other = pipe.transformer(**swapped, return_dict=False)[0]
    assert (other[:, :16] - out[:, :16]).abs().max() > 1e-4, "the references' order does not reach the prediction"


def test_two_ranks_and_a_resume_learn_what_one_rank_with_double_batch_learns(runs):
    assert_pair_runs_agree(runs, "qwenimage_edit")


def test_stock_diffusers_loads_the_lora_and_the_image_depends_on_the_reference(runs, pipe, pairs):
    from xeonsd.families.qwenimage_edit.training import TRAINING as EDIT

    def image(pipeline, ref: Image.Image) -> np.ndarray:
        # the pipeline encodes a reference at ~1 MP; as the run's validation does, at the 64 px it trained at
        with EDIT.rendering(64):
            return edit(pipeline, ref)

    assert_edit_depends_on_the_reference(pipe, runs(1), pairs, image)


def test_two_references_per_image_train_and_what_cannot_train_is_refused(edit_model, pairs, tmp_path):
    two = tmp_path / "two"
    shutil.copytree(pairs, two)
    rows = [json.loads(x) for x in (two / "metadata.jsonl").read_text().splitlines()]
    for r in rows:
        r["cond_image"] = [r["cond_image"], "ref/p4.png"]
    (two / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    args = method_args("lora", edit_model, two, out, "--cond_image_column=cond_image", "--rank=2", steps=2)
    proc = train(args, dict(ENV))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / LORA_FILE).is_file()

    def refusal(data: Path, *extra: str) -> str:
        return refused(method_args("lora", edit_model, data, tmp_path / "refused", *extra), dict(ENV))

    assert "Qwen-Image-Edit-2511 (QwenImageEditPlusPipeline) edits reference images" in refusal(pairs)
    for r in rows:
        r["cond_image"] = ["ref/p0.png", "ref/p1.png", "ref/p2.png", "ref/p3.png"]
    (two / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "4 reference images for p0.png; this model takes at most 3" in refusal(two, "--cond_image_column=cond_image")
    err = refusal(pairs, "--cond_image_column=cond_image", "--caption_dropout=0.1")
    assert "--caption_dropout with --cond_image_column: Qwen-Image-Edit-2511's text encoder reads" in err


@torch.no_grad()
def test_the_lora_learns_the_edit_in_stock_diffusers(learned, pipe, pairs):
    """The learning proof on pairs (red square -> the same square blue): for the training pairs' references, the
    pipeline with the LoRA generates latents nearer each pair's edited image than the base model does, same seeds.
    Measured in the latent space (the tiny VAE is random): the edited images' latents as the trainer caches them."""
    from xeonsd.families.flow import pack
    from xeonsd.families.qwenimage_edit.training import TRAINING as EDIT

    shift, scaling = EDIT.latent_affine(pipe.vae)
    names = [f"p{i}.png" for i in range(4)]

    def pixels(path: Path) -> torch.Tensor:
        return torch.from_numpy(np.asarray(Image.open(path).convert("RGB"), np.float32) / 127.5 - 1).permute(2, 0, 1)

    edited = torch.stack([pixels(pairs / n) for n in names])
    target = pack((EDIT.latent_vae(pipe.vae).encode(edited).latent_dist.mean - shift) * scaling)

    def latents() -> torch.Tensor:
        out = []
        with EDIT.rendering(64):
            for k, n in enumerate(names):
                ref = Image.open(pairs / "ref" / n).convert("RGB")
                kw = {"num_inference_steps": 10, "height": 64, "width": 64, "output_type": "latent"}
                out.append(pipe(image=ref, prompt=PROMPT, generator=torch.Generator().manual_seed(k), **kw).images[0])
        return torch.stack(out)

    before = latents()
    pipe.load_lora_weights(str(learned), weight_name=LORA_FILE, adapter_name="learned")
    try:
        after = latents()
    finally:
        pipe.delete_adapters("learned")
    a, b = (float(((x - target) ** 2).mean().sqrt()) for x in (before, after))
    print(f"Qwen-Image-Edit LoRA: latent RMS distance to the edits {a:.3f} -> {b:.3f} ({b / a:.2f})")
    assert b <= MARGIN * a, (a, b)
