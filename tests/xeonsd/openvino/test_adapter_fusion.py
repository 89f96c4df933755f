"""DoRA and LoKr runs fused into OpenVINO exports of their own (``xeonsd export --lora``,
:mod:`xeonsd.openvino.adapter_fusion`), on the tiny SD pipeline: one short run of each, trained once for the module.

* the fused export's images differ from the base export's and match stock diffusers PyTorch with the adapter loaded
  unmerged (DoRA: ``load_lora_weights``; LoKr: ``PeftModel.from_pretrained`` on the UNet), same seed and scheduler:
  the merge is the adapter (for DoRA: its magnitudes applied);
* ``--lora-scale`` scales a LoKr's merged update; ``generate --engine torch --lora`` merges a LoKr run too;
* LoHa on the UNet, LoHa and LoKr on FLUX.1's transformer: ``fuse_peft``'s merged layers give what peft's unmerged
  layers give at the scale (layer by layer: the fusion is the part that differs by adapter type and denoiser);
* a LoKr file for another base model, or a directory that is no peft adapter, is refused in one line naming it;
  GenAI's runtime LoRA (``generate --lora`` on an export) refuses DoRA, pointing at the fused export.

Images are compared as uint8 pixels (0..255); "mean" is the mean absolute difference over all pixels.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_runs import method_args
from ov_assets import BATCH, SIZE, STEPS, _export, as_array, torch_images

from xeonsd import cli
from xeonsd.openvino.generate import GenerateOptions, generate
from xeonsd.openvino.manifest import MANIFEST

PROMPT = "a photo of toy"
SEED = 5
FILES = {"dora": "pytorch_lora_weights.safetensors", "lokr": "adapter_model.safetensors"}


@pytest.fixture(scope="module")
def runs(tiny_model: Path, dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 3-step DoRA and LoKr run on the UNet by type (rank 2, a large learning rate and LoKr's alpha 8, so the
    adapter shows); the two trainers run side by side (most of a short run is its start-up)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    root = tmp_path_factory.mktemp("adapter-fusion")
    procs = {}
    for kind in FILES:
        flags = (f"--instance_prompt={PROMPT}", "--rank=2", "--learning_rate=5e-2", f"--adapter={kind}")
        flags += ("--lora_alpha=8",) if kind == "lokr" else ()  # w1 starts at 0: 3 steps alone barely show
        args = [
            sys.executable,
            "-m",
            "xeonsd.cli",
            "train",
            *method_args("lora", tiny_model, dataset, root / kind, *flags),
        ]
        procs[kind] = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for kind, proc in procs.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{kind}: {err[-3000:]}"
    return {kind: root / kind for kind in FILES}


@pytest.fixture(scope="module")
def fused(tiny_model: Path, runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each run fused into an export: DoRA given as its file, LoKr as its run directory."""
    root = tmp_path_factory.mktemp("ov-fused")
    return {
        "dora": _export(tiny_model, root / "dora", lora=runs["dora"] / FILES["dora"]),
        "lokr": _export(tiny_model, root / "lokr", lora=runs["lokr"]),
    }


def _images(ov_dir: Path, engine: str = "optimum", **kw) -> np.ndarray:
    opts = GenerateOptions(prompts=(PROMPT,), num_images=BATCH, steps=STEPS, seed=SEED, engine=engine, **kw)
    images, _ = generate(ov_dir, opts)
    return as_array(images)


def _torch_pipeline(tiny_model: Path, kind: str, run: Path):
    """Stock diffusers PyTorch with the adapter loaded as its type loads (unmerged)."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    if kind == "dora":
        pipe.load_lora_weights(str(run), weight_name=FILES["dora"])
    else:
        from peft import PeftModel

        PeftModel.from_pretrained(pipe.unet, str(run))
    return pipe


@pytest.fixture(scope="module")
def references(tiny_model: Path, runs: dict[str, Path]) -> dict[str, np.ndarray]:
    return {kind: torch_images(_torch_pipeline(tiny_model, kind, run), PROMPT, SEED) for kind, run in runs.items()}


@pytest.mark.parametrize("kind", ["dora", "lokr"])
def test_a_fused_export_is_the_adapter_as_pytorch_applies_it(
    kind: str, runs: dict[str, Path], fused: dict[str, Path], references: dict[str, np.ndarray], ov_base: Path
) -> None:
    """Tolerance: mean < 1.5 and every image within 3.0 of PyTorch (the plain LoRA fused export's, in
    test_lora_openvino); the adapter moves the images by more than 5 from the base export's."""
    reference = references[kind]
    images = _images(fused[kind])
    per_image = np.abs(images - reference).mean(axis=(1, 2, 3))
    moved = float(np.abs(images - _images(ov_base)).mean())
    print(f"{kind}: fused export vs PyTorch {per_image.mean():.3f} (max {per_image.max():.3f}); vs base {moved:.2f}")
    assert per_image.mean() < 1.5 and per_image.max() < 3.0, per_image
    assert moved > 5.0, "the adapter must change the images for the comparison to mean anything"
    manifest = json.loads((fused[kind] / MANIFEST).read_text())
    assert (manifest["lora"]["file"], manifest["lora"]["scale"]) == (str(runs[kind] / FILES[kind]), 1.0)


def test_the_scale_scales_a_lokr_update_and_the_torch_engine_merges_it(
    tiny_model: Path, runs: dict[str, Path], references: dict[str, np.ndarray]
) -> None:
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import load_file

    from xeonsd.families import REGISTRY
    from xeonsd.openvino.adapter_fusion import fuse_peft

    sd = next(s for s in REGISTRY if s.name == "sd")
    lokr = runs["lokr"] / FILES["lokr"]
    weights = {0.0: load_file(str(tiny_model / "unet" / "diffusion_pytorch_model.safetensors"))}
    for scale in (0.5, 1.0):
        pipe = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None, requires_safety_checker=False)
        fuse_peft(pipe, sd, lokr, scale, "the tiny model")
        weights[scale] = pipe.unet.state_dict()
    name = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight"
    delta = weights[1.0][name] - weights[0.0][name]
    assert delta.abs().max() > 1e-4 and set(weights[0.5]) == set(weights[0.0])  # merged: no adapter keys left
    torch.testing.assert_close(weights[0.5][name] - weights[0.0][name], 0.5 * delta, atol=1e-6, rtol=1e-4)

    images = _images(tiny_model, "torch", loras=((lokr, 1.0),), precision="f32", height=SIZE, width=SIZE)
    assert np.abs(images - references["lokr"]).mean() < 1.0


def _cli_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_what_cannot_be_fused_is_refused_in_one_line(
    tiny_model: Path, runs: dict[str, Path], ov_base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other"
    shutil.copytree(runs["lokr"], other)
    tensors = load_file(str(other / FILES["lokr"]))
    save_file({k.replace("down_blocks.0.", "down_blocks.7.", 1): v for k, v in tensors.items()}, other / FILES["lokr"])
    err = _cli_error(["export", str(tiny_model), str(tmp_path / "ov"), "--lora", str(other)], capsys)
    assert f"{other / FILES['lokr']} was made for another base model than the source {tiny_model}" in err
    assert "has no module down_blocks.7.attentions.0" in err
    (other / "adapter_config.json").unlink()
    err = _cli_error(["export", str(tiny_model), str(tmp_path / "ov"), "--lora", str(other)], capsys)
    assert f"{other} is no adapter in peft's layout: it needs adapter_model.safetensors and" in err
    assert not (tmp_path / "ov").exists()
    dora = runs["dora"] / FILES["dora"]  # GenAI applies B A only: the runtime LoRA points at the fused export
    err = _cli_error(["generate", str(ov_base), "--lora", str(dora), "--out", str(tmp_path / "o")], capsys)
    assert f"{dora} is a DoRA adapter, not plain LoRA" in err and f"xeonsd export SRC OUT --lora {dora}" in err


@pytest.mark.parametrize(
    ("kind", "family", "model"),
    [("loha", "sd", "tiny_model"), ("loha", "flux", "tiny_flux_model"), ("lokr", "flux", "tiny_flux_model")],
)
def test_a_loha_or_lokr_fuses_into_a_unet_or_a_transformer_as_peft_applies_it_unmerged(
    kind: str, family: str, model: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The fusion behind ``export --lora`` for LoHa (the DoRA and LoKr exports above are compared image by image)
    and for a transformer family's denoiser: an adapter of peft's with random factors (peft's ``init_weights=False``)
    saved as a run saves it, fused at scale 0.7 by ``fuse_peft``; every adapted layer of the fused denoiser gives,
    on random inputs, what the unmerged adapter layer gives at that scale (its base layer plus 0.7 of its update)."""
    import copy

    from diffusers import DiffusionPipeline
    from peft import LoHaConfig, LoKrConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    from xeonsd.families import REGISTRY
    from xeonsd.openvino.adapter_fusion import fuse_peft

    spec = next(s for s in REGISTRY if s.name == family)
    pipe = DiffusionPipeline.from_pretrained(request.getfixturevalue(model))
    denoiser = getattr(pipe, spec.denoiser)
    config = {"loha": LoHaConfig, "lokr": LoKrConfig}[kind](
        r=2, alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_weights=False
    )
    torch.manual_seed(0)
    unmerged = get_peft_model(copy.deepcopy(denoiser), config)
    unmerged.save_pretrained(tmp_path)
    layers = {
        n.removeprefix("base_model.model."): m for n, m in unmerged.named_modules() if isinstance(m, BaseTunerLayer)
    }
    for layer in layers.values():
        layer.scale_layer(0.7)
    assert len(layers) >= 4

    with torch.no_grad():  # the inputs, and the base layers' outputs before the fusion changes them in place
        modules = dict(denoiser.named_modules())
        inputs = {name: torch.randn(3, modules[name].in_features) for name in layers}
        before = {name: modules[name](x) for name, x in inputs.items()}
    assert fuse_peft(pipe, spec, tmp_path / "adapter_model.safetensors", 0.7, "the tiny model") == len(layers)
    fused = dict(getattr(pipe, spec.denoiser).named_modules())
    assert not any(isinstance(m, BaseTunerLayer) for m in fused.values())  # merged: plain layers again
    with torch.no_grad():
        for name, x in inputs.items():
            torch.testing.assert_close(fused[name](x), layers[name](x), atol=1e-5, rtol=1e-4)
        moved = max(float((fused[name](x) - before[name]).abs().max()) for name, x in inputs.items())
    assert moved > 1e-3, "the adapter must change the layers for the comparison to mean anything"
