"""Krea 2 (``families/krea2/``) on its tiny pipeline (``make-tiny-model --arch tiny-krea2``: the single-stream DiT,
a two-layer Qwen3VLModel whose two layers are tapped, Qwen-Image's VAE), trained under real mpirun:

* detection: a ``Krea2Pipeline`` on ``Krea2Transformer2DModel`` with ``Qwen3VLModel``, with its own settings from
  model_index.json (the tapped layers, ``is_distilled``);
* what the transformer gets is what diffusers' Krea2Pipeline and train_dreambooth_lora_krea2.py compute: two prompts
  of different lengths encoded alone (suffix after the prompt) give the prediction of the pipeline's fixed-length
  layout (padding in the middle of the template), σ from the unshifted grid, the velocity target;
* 2 ranks x batch 1 learn what 1 rank x batch 2 learns (captions of different lengths: a batch of 2 masks the
  shorter), with the held-out images' validation loss and a validation image; a resume of the 2-rank run's step-2
  checkpoint ends where the uninterrupted run ends;
* stock ``Krea2Pipeline.load_lora_weights`` loads the LoRA and the image changes; the file reads as Krea 2's;
* ``--inference_model`` (train on RAW, validate on Turbo; the 1-rank run's): the validation images are the Turbo
  stand-in's with the adapters (what stock diffusers renders with the LoRA on it, 8 steps without guidance);
  another family's model, one whose transformer has another shape, a missing validation prompt and textual inversion
  are refused in one line.
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
from safetensors.torch import load_file, save_file
from test_learning import concept  # noqa: F401 - the fixture
from test_methods import LORA_FILE, assert_same_training

PROMPT = "a photo of sks toy"
# captions of different lengths: a batch of two pads one and masks it
CAPTIONS = (
    "a photo of sks toy",
    "a photo of sks toy, a red card with a white square in the middle of it",
    "sks toy",
    "a red sks toy with a white square",
)
FLAGS = (
    "--rank=2",
    "--lora_alpha=4",
    "--learning_rate=1e-2",
    "--checkpointing_steps=2",
    "--validation_split=0.25",
    "--validation_steps=2",
    f"--validation_prompt={PROMPT}",
    "--num_validation_images=1",
)


@pytest.fixture(scope="module")
def krea2_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from xeonsd.assets import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("assets") / "tiny-krea2", arch="tiny-krea2")


@pytest.fixture(scope="module")
def turbo_model(krea2_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stand-in for Krea 2 Turbo: the tiny RAW pipeline marked ``is_distilled``, its transformer's weights moved."""
    out = tmp_path_factory.mktemp("assets") / "tiny-krea2-turbo"
    shutil.copytree(krea2_model, out)
    index = json.loads((out / "model_index.json").read_text())
    (out / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    g = torch.Generator().manual_seed(1)
    for f in (out / "transformer").glob("*.safetensors"):
        weights = load_file(str(f))
        save_file({k: v + 0.2 * torch.randn(v.shape, generator=g) for k, v in weights.items()}, str(f))
    return out


@pytest.fixture(scope="module")
def pipe(krea2_model):
    from diffusers import Krea2Pipeline

    p = Krea2Pipeline.from_pretrained(krea2_model)
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture(scope="module")
def runs(krea2_model, turbo_model, concept, tmp_path_factory):  # noqa: F811 - the imported fixture
    """``runs(ranks, kind)``: 4 steps of FLAGS on the captioned concept, trained once: 2 ranks x batch 1, or 1 rank x
    batch 2 validated on the Turbo stand-in (``--inference_model``: what it renders changes nothing of the training,
    so the two runs still learn the same); ``resume``: the 2-rank run's checkpoint-2 resumed on 1 rank x batch 2."""
    root = tmp_path_factory.mktemp("krea2-runs")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    data = root / "captioned"
    shutil.copytree(concept, data)
    for image, caption in zip(sorted(data.glob("*.png")), CAPTIONS, strict=True):
        image.with_suffix(".txt").write_text(caption)
    done: dict[tuple, Path] = {}

    def run(ranks: int, kind: str = "short") -> Path:
        if (ranks, kind) not in done:
            out = root / f"{ranks}-{kind}"
            flags = FLAGS
            if kind == "resume":
                out.mkdir()
                shutil.copytree(run(2) / "checkpoint-2", out / "checkpoint-2")
                flags += ("--resume_from_checkpoint=latest",)
            if (ranks, kind) == (1, "short"):
                flags += (f"--inference_model={turbo_model}",)
            args = method_args("lora", krea2_model, data, out, *flags, steps=4, batch=2 if ranks == 1 else 1)
            (root / f"{out.name}.log").write_text(train(args, env, ranks=ranks).stderr)
            done[(ranks, kind)] = out
        return done[(ranks, kind)]

    run.root = root  # type: ignore[attr-defined]
    run.env = env  # type: ignore[attr-defined]
    run.data = data  # type: ignore[attr-defined]
    return run


def lora_b(path: Path) -> dict[str, torch.Tensor]:
    """The adapters' B matrices: they start at zero, so their value is what the run learned."""
    return {k: v for k, v in load_file(str(path / LORA_FILE)).items() if "lora_B" in k}


def log_of(runs, out: Path) -> str:
    return (runs.root / f"{out.name}.log").read_text()


def test_krea2_is_detected_with_its_pipeline_settings(krea2_model, turbo_model):
    from xeonsd.families import by_name, detect_family

    raw, turbo = detect_family(krea2_model), detect_family(turbo_model)
    assert raw.spec is turbo.spec is by_name("krea2")
    assert raw.spec.encoder_classes == ("Qwen3VLModel",) and raw.spec.vae_class == "AutoencoderKLQwenImage"
    settings = dict(raw.pipeline_config)
    assert settings == {"text_encoder_select_layers": (1, 2), "is_distilled": False, "patch_size": 2}
    assert dict(turbo.pipeline_config)["is_distilled"] is True
    assert raw.pixel_multiple == 16 and not raw.spec.resolution_shift


def test_the_transformer_gets_what_the_script_and_pipeline_compute(pipe, krea2_model):
    """Two prompts of different lengths through the family's conditioning, joined as prior preservation joins rows,
    against the pipeline's fixed-length encode_prompt and the script's pack/position ids/call/unpack."""
    import dataclasses

    from diffusers import Krea2Pipeline

    from xeonsd.families import detect_family
    from xeonsd.families.krea2.training import TRAINING as KREA2
    from xeonsd.families.krea2.training import Krea2PromptConditioning
    from xeonsd.trainer.flow import FlowSchedule
    from xeonsd.trainer.prompt_tables import PromptTable

    flow = FlowSchedule.from_config(pipe.scheduler.config, "none", 0.0, 1.0, 1.29)
    models = SimpleNamespace(
        tokenizer=pipe.tokenizer,
        text_encoder=pipe.text_encoder,
        text_pairs=[(pipe.tokenizer, pipe.text_encoder)],
        weight_dtype=torch.float32,
        text_length=64,
        text_pending={},  # every encoder loaded
        unet_dtype=torch.float32,
        unet_autocast=False,
        flow=flow,
        family=detect_family(krea2_model),
    )
    short, long = PROMPT, "a photo of a toy that is red and has a white square on it"
    inputs = [
        Krea2PromptConditioning(models, PromptTable((p,), per_image=False, source="x"), False, 0, 1).unet_inputs(
            None, [SimpleNamespace(template=0, index=0, input_id=0)]
        )
        for p in (short, long)
    ]
    hidden = torch.cat([h for h, _ in inputs])
    added = {"mask": torch.cat([a["mask"] for _, a in inputs])}
    g = torch.Generator().manual_seed(0)
    latents, noise = torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 16, 8, 8, generator=g)
    sigmas = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        pred, target = KREA2.predict(models, pipe.transformer, latents, noise, sigmas, hidden, added)

        embeds, mask = pipe.encode_prompt([short, long], max_sequence_length=64)  # [prefix | prompt | PAD | suffix]
        # 64 text tokens (66: the tiny tokenizer's suffix is 7 tokens, the real one's 5), 2 taps of 32
        assert embeds.shape == (2, 66, 2, 32) and not mask.all()
        s = sigmas.view(2, 1, 1, 1)
        noisy = (1 - s) * latents + s * noise
        packed = pipe._pack_latents(noisy, 2, 16, 8, 8)
        timesteps = sigmas * 1000  # the unshifted grid's timesteps, given as timesteps / 1000
        out = pipe.transformer(
            hidden_states=packed,
            encoder_hidden_states=embeds,
            timestep=timesteps / 1000,
            position_ids=Krea2Pipeline.prepare_position_ids(embeds.shape[1], 4, 4, "cpu"),
            encoder_attention_mask=mask,
            return_dict=False,
        )[0]
        expected = pipe._unpack_latents(out, 64, 64)[:, :, 0]
    assert torch.allclose(pred, expected, atol=1e-5), (pred - expected).abs().max()
    assert torch.equal(target, noise - latents)
    # σ: the scheduler's training grid as it stands (use_dynamic_shifting: unshifted), at index ⌊u·N⌋
    grid = dataclasses.replace(flow, dynamic=False)
    for u in (0.0, 0.1234, 0.5, 0.999):
        assert grid.sigma(u, (16, 8, 8)) == pytest.approx(float(pipe.scheduler.sigmas[int(u * 1000)]), abs=1e-7)


def test_two_ranks_and_a_resume_learn_what_one_rank_with_double_batch_learns(runs):
    one, two, resumed = runs(1), runs(2), runs(1, "resume")
    summary = json.loads((two / "train_summary.json").read_text())
    assert summary["family"] == "krea2" and summary["ranks"] == 2 and "inference_model" not in summary
    assert summary["loss"]["weighting_scheme"] == "none" and summary["loss"]["shift"] == 1.0  # the script's grid
    zero = {k: torch.zeros_like(v) for k, v in lora_b(one).items()}
    assert_same_training(lora_b(one), lora_b(two), zero)
    assert "resumed from" in log_of(runs, resumed)
    assert_same_training(lora_b(one), lora_b(resumed), zero)
    assert "Qwen3VLModel freed: every prompt is encoded" in log_of(runs, one)
    with Image.open(two / "validation" / "final" / "00.png") as im:
        assert im.size == (64, 64)
    rows = [[json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (one, two)]
    val = [[r["val_loss"] for r in rs if "val_loss" in r] for rs in rows]  # at fixed σ: the same on 1 and 2 ranks
    assert len(val[0]) == 2 and val[0] == pytest.approx(val[1], rel=1e-4)


def test_stock_diffusers_loads_the_lora_and_it_reads_as_krea2(runs, pipe):
    from xeonsd.families import by_name
    from xeonsd.modelfiles.lora_layout import lora_family, read_adapter

    out = runs(1)
    keys = load_file(str(out / LORA_FILE)).keys()
    assert any(".attn.to_gate.lora_A" in k for k in keys) and any("text_fusion.projector" in k for k in keys)
    assert lora_family(read_adapter(out / LORA_FILE))[0] is by_name("krea2")
    kw = {"prompt": PROMPT, "num_inference_steps": 4, "height": 64, "width": 64, "output_type": "np"}
    before = pipe(generator=torch.Generator().manual_seed(0), **kw).images[0]
    pipe.load_lora_weights(str(out), weight_name=LORA_FILE, adapter_name="trained")
    try:
        after = pipe(generator=torch.Generator().manual_seed(0), **kw).images[0]
    finally:
        pipe.delete_adapters("trained")
    assert np.abs(after - before).max() > 1e-3, "the LoRA does not change the image"


def test_validation_on_turbo_is_its_transformer_with_the_adapters(runs, turbo_model):
    """--inference_model (the 1-rank run's): the validation image is what stock diffusers renders on the Turbo
    stand-in with the LoRA (its is_distilled: 8 steps, no guidance), not the RAW one's (the 2-rank run's, which learned
    the same adapters)."""
    from diffusers import Krea2Pipeline

    turbo, raw = runs(1), runs(2)
    summary = json.loads((turbo / "train_summary.json").read_text())
    assert summary["inference_model"] == str(turbo_model)
    assert "validation images on" in log_of(runs, turbo)

    def image(out: Path) -> np.ndarray:
        with Image.open(out / "validation" / "final" / "00.png") as im:
            return np.asarray(im.convert("RGB"), dtype=np.int16)

    stock = Krea2Pipeline.from_pretrained(turbo_model)
    stock.set_progress_bar_config(disable=True)
    stock.load_lora_weights(str(turbo), weight_name=LORA_FILE)
    kw = {"num_inference_steps": 8, "guidance_scale": 0.0, "height": 64, "width": 64, "output_type": "np"}
    want = stock(PROMPT, generator=torch.Generator().manual_seed(7), **kw).images[0]
    want = np.round(want * 255).astype(np.int16)
    assert np.abs(image(turbo) - want).max() <= 2, "the validation image is not Turbo's with the LoRA"
    assert np.abs(image(turbo) - image(raw)).max() > 10, "the validation image is RAW's"


def test_what_does_not_apply_is_refused_in_one_line(runs, krea2_model, tmp_path):
    from xeonsd.assets import make_tiny_model

    qwen = make_tiny_model(tmp_path / "qwen", arch="tiny-qwenimage", configs_only=True)
    deeper = tmp_path / "deeper"  # a Krea 2 whose transformer has a block more: the configs are what is read
    for name in ("model_index.json", "vae/config.json", "transformer/config.json"):
        (deeper / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(krea2_model / name, deeper / name)
    config = json.loads((deeper / "transformer/config.json").read_text())
    (deeper / "transformer/config.json").write_text(json.dumps({**config, "num_layers": 3}))
    base = [f"--pretrained_model_name_or_path={krea2_model}", f"--train_data_dir={runs.data}"]
    base += ["--resolution=64", f"--output_dir={tmp_path / 'out'}"]
    for flags, said in (
        (
            ("--method=textual_inversion", "--placeholder_token=<sks>", "--initializer_token=toy", "--captions=off"),
            "Krea 2",
        ),
        (
            ("--method=lora", f"--inference_model={qwen}", f"--validation_prompt={PROMPT}"),
            f"--inference_model {qwen} is a Qwen-Image pipeline (QwenImagePipeline), but the base model is Krea 2",
        ),
        (
            ("--method=lora", f"--inference_model={deeper}", f"--validation_prompt={PROMPT}"),
            "its transformer is not the base model's shape (num_layers 3 against 2)",
        ),
        (("--method=lora", f"--inference_model={krea2_model}"), "--inference_model renders the validation images"),
    ):
        err = refused([*base, *flags], runs.env)
        lines = [x for x in err.strip().splitlines() if x.strip()]
        assert len(lines) == 1 and said in lines[0], err
    assert not (tmp_path / "out").exists()
