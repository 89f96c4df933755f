"""FLUX.2 [dev] (``families/flux2_dev/``) on its tiny pipeline (``make-tiny-model --arch tiny-flux2-dev``: klein's
transformer class with a guidance embedding, a 30-layer Mistral3 with a tiny Pixtral tower, in a ``Flux2Pipeline``),
trained on image pairs under real mpirun:

* it is told from FLUX.2 [klein] by the pipeline's class (one transformer class, two families), and a pipeline whose
  text encoder is the other family's is refused naming both;
* the prompt embeddings are ``Flux2Pipeline.encode_prompt``'s (FLUX.2's system message, Mistral3's layers 10, 20,
  30), the guidance input is --guidance_scale, and the reference's tokens and ids are what the pipeline passes for
  ``image=``, the prediction keeping the noisy tokens only;
* 2 ranks x batch 1 learn what 1 rank x batch 2 learns, with the held-out pairs' validation loss and a validation
  image made from a reference; a resume of the 2-rank run's step-2 checkpoint ends where the uninterrupted run ends;
* stock ``Flux2Pipeline.load_lora_weights`` loads the LoRA, the image changes and depends on the reference;
* textual inversion is refused in one line, and ``xeonsd export`` says in one line that optimum-intel has no export.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cli_runs import method_args, refused, run_cli
from safetensors.torch import load_file
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


@pytest.fixture(scope="module")
def dev_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from xeonsd.assets import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("assets") / "tiny-flux2-dev", arch="tiny-flux2-dev")


@pytest.fixture(scope="module")
def pipe(dev_model):
    from diffusers import Flux2Pipeline

    p = Flux2Pipeline.from_pretrained(dev_model)
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_pairs(tmp_path_factory.mktemp("dev-pairs") / "data")


@pytest.fixture(scope="module")
def runs(dev_model, pairs, tmp_path_factory):
    return pair_runs(dev_model, pairs, tmp_path_factory.mktemp("dev-runs"), FLAGS)


def test_dev_is_told_from_klein_by_its_pipeline_and_its_text_encoder(dev_model, tmp_path):
    from xeonsd.families import FamilyError, by_name, detect_family

    dev = detect_family(dev_model)
    assert dev.spec is by_name("flux2_dev") and dev.spec.denoiser_class == by_name("flux2").denoiser_class
    assert dev.guidance_embeds and dev.default_resolution == 64 and dev.pixel_multiple == 16
    for name, cls, encoder in (
        ("klein-class", "Flux2KleinPipeline", "Mistral3ForConditionalGeneration"),
        ("qwen-encoder", "Flux2Pipeline", "Qwen3ForCausalLM"),
    ):
        d = tmp_path / name
        for part in ("transformer", "vae"):
            (d / part).mkdir(parents=True)
            shutil.copy(dev_model / part / "config.json", d / part)
        index = json.loads((dev_model / "model_index.json").read_text())
        index.update(_class_name=cls, text_encoder=["transformers", encoder])
        (d / "model_index.json").write_text(json.dumps(index))
        with pytest.raises(FamilyError, match=f"whose text_encoder is {encoder}, not FLUX.2 .*'s"):
            detect_family(d)


@torch.no_grad()
def test_the_family_feeds_the_transformer_what_the_pipeline_computes(pipe):
    """The prompt embeddings and text ids against Flux2Pipeline.encode_prompt, the guidance input, the reference's
    latents and ids against prepare_image_latents, the call's tokens against the pipeline's concatenation, and the
    prediction of the noisy tokens only."""
    from xeonsd.families.flux2.training import pack
    from xeonsd.families.flux2_dev.training import TRAINING as DEV

    cond = DEV.conditioning.__new__(DEV.conditioning)  # its encoder hooks, without a prompt table
    cond.models = SimpleNamespace(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, text_length=512)
    hidden = cond._t5(cond._tokenize([PROMPT, ""])[-1])
    expected, text_ids = pipe.encode_prompt([PROMPT, ""], device="cpu", max_sequence_length=512)
    assert torch.equal(hidden, expected)  # layers 10, 20, 30 of the system message and the prompt, side by side

    g = torch.Generator().manual_seed(0)
    pixels = torch.rand(1, 3, 64, 64, generator=g) * 2 - 1
    shift, scaling = DEV.latent_affine(pipe.vae)
    reference = (DEV.latent_vae(pipe.vae).encode(pixels).latent_dist.mean - shift) * scaling
    theirs, their_ids = pipe.prepare_image_latents([pixels], 1, g, "cpu", torch.float32)
    assert torch.allclose(pack(reference), theirs, atol=1e-5)

    noisy = torch.randn(1, 128, 4, 4, generator=g)
    sigmas = torch.tensor([0.5])
    flow = SimpleNamespace(guidance=3.5)  # --guidance_scale, the scripts' default
    kw = DEV.denoiser_kwargs(
        pipe.transformer.config, noisy, sigmas, hidden[:1], None, {"references": (reference,)}, flow
    )
    latent_ids = pipe._prepare_latent_ids(noisy)
    assert torch.allclose(kw["hidden_states"], torch.cat([pipe._pack_latents(noisy), theirs], dim=1), atol=1e-5)
    assert torch.equal(kw["img_ids"], torch.cat([latent_ids, their_ids], dim=1))
    assert torch.equal(kw["txt_ids"], text_ids[:1]) and torch.equal(kw["guidance"], torch.tensor([3.5]))
    out = pipe.transformer(**kw, return_dict=False)[0]
    assert out.shape[1] == 2 * 16  # the noisy tokens and the reference's
    assert torch.equal(DEV.unpack(out, noisy.shape), pipe._unpack_latents_with_ids(out[:, :16], latent_ids))


def test_two_ranks_and_a_resume_learn_what_one_rank_with_double_batch_learns(runs):
    assert_pair_runs_agree(runs, "flux2_dev")
    summary = json.loads((runs(2) / "train_summary.json").read_text())
    assert summary["loss"]["guidance_scale"] == 3.5 and summary["loss"]["shift"] == 1.0  # the unshifted grid
    text = (runs.root / f"{runs(1).name}.log").read_text()
    assert "Mistral3ForConditionalGeneration freed: every prompt is encoded" in text


def test_stock_diffusers_loads_the_lora_and_the_image_depends_on_the_reference(runs, pipe, pairs):
    from xeonsd.families import by_name
    from xeonsd.modelfiles.lora_layout import check_family, read_adapter

    out = runs(1)
    keys = load_file(str(out / LORA_FILE)).keys()
    assert {k.split(".", 1)[0] for k in keys} == {"transformer"}  # Mistral3 never gets adapters
    assert any(".attn.to_qkv_mlp_proj." in k for k in keys) and any(".1.attn.to_out." in k for k in keys)
    modules = read_adapter(out / LORA_FILE)
    for family in ("flux2_dev", "flux2"):  # klein's module names: the file does not tell the two apart
        check_family(out / LORA_FILE, modules, by_name(family), "the tiny model")
    assert_edit_depends_on_the_reference(pipe, out, pairs, edit)


def test_textual_inversion_and_the_export_are_refused_in_one_line(dev_model, pairs, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    ti = refused(method_args("textual_inversion", dev_model, pairs, tmp_path / "ti", "--captions=off"), env).strip()
    assert "not supported on FLUX.2 [dev]" in ti and "\n" not in ti
    proc = run_cli(["export", str(dev_model), str(tmp_path / "ov")], dict(env))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "FLUX.2 [dev] (Flux2Pipeline), which optimum-intel has no OpenVINO export for" in proc.stderr
    assert not (tmp_path / "ov").exists()


def test_full_fine_tuning_of_a_pipeline_naming_the_pixtral_processor_is_refused_before_training(
    dev_model, pairs, tmp_path
):
    """The released model's model_index.json names a PixtralProcessor, which transformers 5.5 builds only with
    torchvision: --method full, whose save re-reads the base's components, is refused before any training."""
    import transformers

    if type(transformers.PixtralProcessor).__name__ != "DummyObject":
        pytest.skip("torchvision is installed: the processor loads")
    model = tmp_path / "released-layout"
    shutil.copytree(dev_model, model)
    index = json.loads((model / "model_index.json").read_text())
    (model / "model_index.json").write_text(json.dumps({**index, "tokenizer": ["transformers", "PixtralProcessor"]}))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    message = refused(method_args("full", model, pairs, tmp_path / "out"), env).strip()
    assert (
        "reading the base's tokenizer (PixtralProcessor, from transformers) again, which needs torchvision" in message
    )
    assert "\n" not in message
