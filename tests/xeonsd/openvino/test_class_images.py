"""Prior preservation's class images through OpenVINO (``xeonsd train --class_export``): with an export of the base
model in the directory of exports, the missing class images are the export's own images for their seeds; without
one there, the trainer falls back to PyTorch and says so (tests/xeonsd/trainer/test_prior.py)."""

from __future__ import annotations

import numpy as np
from cli_runs import method_args, train
from PIL import Image

from xeonsd.modelfiles.modelsource import model_fingerprint
from xeonsd.openvino.class_images import base_export, open_class_renderer
from xeonsd.trainer.prior import CLASS_STEPS
from xeonsd.trainer.rng import CLASS_IMAGE_SEED, mix

CLASS_PROMPT = "a photo of toy"


def test_missing_class_images_are_rendered_through_the_base_models_export(
    tiny_model, dataset, ov_base, tmp_path, cli_env
):
    class_dir = tmp_path / "class"
    flags = ["--instance_prompt=a photo of sks toy", "--with_prior_preservation", f"--class_prompt={CLASS_PROMPT}"]
    flags += [f"--class_data_dir={class_dir}", "--num_class_images=2", f"--class_export={ov_base.parent}"]
    proc = train(method_args("lora", tiny_model, dataset, tmp_path / "out", *flags, steps=1), cli_env)
    assert "generating 2 of 2 class image(s)" in proc.stderr and "(OpenVINO on 1 rank(s))" in proc.stderr
    assert f"renders through the OpenVINO export {ov_base}" in proc.stderr
    # the files are the export's images for each image's seed (64 px: the training resolution, not the export's)
    render, used = open_class_renderer(ov_base.parent, model_fingerprint(str(tiny_model)), 64, CLASS_STEPS)
    assert used == ov_base
    for i in range(2):
        want = np.asarray(render(CLASS_PROMPT, mix(CLASS_IMAGE_SEED, i)).convert("RGB"))
        with Image.open(class_dir / f"class-{i:05d}.png") as im:
            assert im.size == (64, 64)
            assert np.array_equal(np.asarray(im.convert("RGB")), want), f"class-{i:05d}.png"


def test_only_an_export_of_the_base_model_itself_is_chosen(tiny_model, ov_base, tmp_path):
    assert base_export(ov_base.parent, "another-model-fingerprint") is None
    assert base_export(tmp_path / "nothing-here", model_fingerprint(str(tiny_model))) is None
    assert base_export(ov_base, model_fingerprint(str(tiny_model)))[0] == ov_base  # an export named itself
