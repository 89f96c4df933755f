"""FLUX.1 Kontext (``families/flux_kontext/``) on its tiny pipeline (``make-tiny-model --arch tiny-flux-kontext``:
FLUX.1's tiny structure in a ``FluxKontextPipeline``), trained on image pairs under real mpirun:

* it is told from FLUX.1 by the pipeline's class (one transformer class, two families);
* the reference's tokens and position ids are what FluxKontextPipeline passes for ``image=`` (first coordinate 1),
  and the prediction keeps the noisy tokens only;
* 2 ranks x batch 1 learn what 1 rank x batch 2 learns, with the held-out pairs' validation loss and a validation
  image at --resolution; a resume of the 2-rank run's step-2 checkpoint ends where the uninterrupted run ends;
* stock ``FluxKontextPipeline.load_lora_weights`` loads the LoRA, the image changes and depends on the reference;
* ``xeonsd export`` says in one line that optimum-intel has no export for it, and export.yml's route instead (no
  export, ``xeonsd generate --engine torch`` with the LoRA and the run's sample reference) makes the run's image.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_runs import run_cli
from PIL import Image
from test_flux2_edit_train import (
    FLAGS,
    assert_edit_depends_on_the_reference,
    assert_pair_runs_agree,
    edit,
    pair_runs,
    write_pairs,
)


@pytest.fixture(scope="module")
def kontext_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from xeonsd.assets import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("assets") / "tiny-flux-kontext", arch="tiny-flux-kontext")


@pytest.fixture(scope="module")
def pipe(kontext_model):
    from diffusers import FluxKontextPipeline

    p = FluxKontextPipeline.from_pretrained(kontext_model)
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_pairs(tmp_path_factory.mktemp("kontext-pairs") / "data")


@pytest.fixture(scope="module")
def runs(kontext_model, pairs, tmp_path_factory):
    return pair_runs(kontext_model, pairs, tmp_path_factory.mktemp("kontext-runs"), FLAGS)


def test_kontext_is_told_from_flux1_by_its_pipeline(kontext_model, tiny_flux_model):
    from xeonsd.families import by_name, detect_family

    kontext, flux = detect_family(kontext_model), detect_family(tiny_flux_model)
    assert kontext.spec is by_name("flux_kontext") and flux.spec is by_name("flux")
    assert kontext.spec.denoiser_class == flux.spec.denoiser_class == "FluxTransformer2DModel"
    assert kontext.guidance_embeds and kontext.default_resolution == 64


@torch.no_grad()
def test_the_reference_joins_the_tokens_as_the_pipeline_passes_image(pipe):
    from xeonsd.families.flow import pack
    from xeonsd.families.flux_kontext.training import TRAINING as KONTEXT

    g = torch.Generator().manual_seed(0)
    reference = torch.randn(1, 16, 8, 8, generator=g)
    noisy = torch.randn(1, 16, 8, 8, generator=g)
    latents, image_latents, latent_ids, image_ids = pipe.prepare_latents(
        reference, 1, 16, 64, 64, torch.float32, "cpu", g
    )
    assert torch.equal(pack(reference), image_latents)
    hidden = torch.randn(1, 8, pipe.transformer.config.joint_attention_dim, generator=g)
    pooled = torch.randn(1, pipe.transformer.config.pooled_projection_dim, generator=g)
    flow = type("Flow", (), {"guidance": 3.5})()
    kw = KONTEXT.denoiser_kwargs(
        pipe.transformer.config, noisy, torch.tensor([0.5]), hidden, pooled, {"references": (reference,)}, flow
    )
    assert torch.equal(kw["hidden_states"], torch.cat([pack(noisy), image_latents], dim=1))
    assert torch.equal(kw["img_ids"], torch.cat([latent_ids, image_ids], dim=0))
    out = pipe.transformer(**kw, return_dict=False)[0]
    assert out.shape[1] == 32  # the noisy tokens and the reference's
    assert torch.equal(KONTEXT.unpack(out, noisy.shape), pipe._unpack_latents(out[:, :16], 64, 64, 8))


def test_two_ranks_and_a_resume_learn_what_one_rank_with_double_batch_learns(runs):
    assert_pair_runs_agree(runs, "flux_kontext")  # the validation image at --resolution, not Kontext's 1 MP


def test_stock_diffusers_loads_the_lora_and_the_image_depends_on_the_reference(runs, pipe, pairs):
    # Kontext's pipeline scales the image and the reference to ~1 MP by default; the tiny model works at 64 px
    def image(pipeline, ref: Image.Image) -> np.ndarray:
        return edit(pipeline, ref, max_area=64 * 64, _auto_resize=False)

    assert_edit_depends_on_the_reference(pipe, runs(1), pairs, image)


def test_export_yml_s_route_makes_the_run_s_images_with_the_torch_engine(runs, kontext_model, pairs, tmp_path):
    """What export.yml does with the run (optimum-intel has no export for Kontext): train_summary.json names the
    reference the validation images were edits of; the filter's route is `xeonsd generate BASE --engine torch` with
    the LoRA and that reference, and it makes the run's image."""
    from repo_code import ansible_code

    from xeonsd import cli

    out = runs(1)
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["sample_references"] == [str((pairs / "ref" / "p0.png").resolve())]
    shape = ["--batch-size", "1", "--height", "64", "--width", "64"]
    route = ansible_code("xeonsd_train").result_export(summary, str(out), 1.0, shape)
    assert route["export"] is False and route["source"] == str(kontext_model)
    images = tmp_path / "images"
    argv = ["generate", route["source"], *route["generate_args"], "--steps", "2", "--num-images", "1"]
    assert cli.main([*argv, "--out", str(images)]) == 0
    timings = json.loads((images / "timings.json").read_text())
    assert (timings["engine"], timings["num_images"]) == ("torch", 1) and (images / "image_000.png").is_file()


def test_export_says_optimum_intel_has_none(kontext_model, tmp_path):
    proc = run_cli(["export", str(kontext_model), str(tmp_path / "ov")], dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "FLUX.1 Kontext (FluxKontextPipeline), which optimum-intel has no OpenVINO export for" in proc.stderr
    assert not (tmp_path / "ov").exists()
