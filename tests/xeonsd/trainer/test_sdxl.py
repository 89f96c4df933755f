"""Every method on the tiny SDXL pipeline (two text encoders, ``text_time`` conditioning), under real mpirun: the
runs of each method are shared by the tests that read their results (one module-scoped cache); the results load
in stock diffusers' ``StableDiffusionXLPipeline``; the memory estimate of the real SDXL architecture (configs only,
no weights); and the families that are refused before any weight loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_runs import method_args, refused, run_cli, train
from safetensors import safe_open
from safetensors.torch import load_file
from test_methods import LORA_FILE, assert_same_training, unet_weights

EMBEDS = "learned_embeds.safetensors"
# Each method's run: LoRA on the UNet and both text encoders with per-image captions, textual inversion on the
# templates (checkpointed half-way for the resume test), full fine-tuning with one instance prompt.
EXTRA = {
    "lora": ("--train_text_encoder", "--rank=2", "--lora_alpha=4", "--learning_rate=1e-2"),
    "textual_inversion": ("--learning_rate=5e-2", "--checkpointing_steps=2"),
    "full": ("--instance_prompt=a photo of toy",),
}
DATA = {"lora": "metadata", "textual_inversion": "plain", "full": "plain"}


def xl_args(method: str, model: Path, data: Path, out: Path, *extra: str, batch: int = 1) -> list[str]:
    """The short run's flags without --resolution: the family's default (64 px for tiny-xl) applies."""
    args = method_args(method, model, data, out, *EXTRA[method], *extra, steps=4, batch=batch)
    return [a for a in args if not a.startswith("--resolution")]


@pytest.fixture(scope="module")
def xl_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from xeonsd.assets import make_dataset

    root = tmp_path_factory.mktemp("xl-data")
    make_dataset(root / "plain", count=4, size=80)  # not the training size: the time ids say 80 x 80 -> 64
    make_dataset(root / "metadata", count=4, size=64, captions="metadata")
    return {"plain": root / "plain", "metadata": root / "metadata"}


@pytest.fixture(scope="module")
def xl_runs(tiny_xl_model, xl_data, tmp_path_factory):
    """``runs(method, ranks, *extra)``: the output dir of that run (1 rank x batch 2, or 2 ranks x batch 1, with the
    extra flags), trained once."""
    import os
    import sys

    root = tmp_path_factory.mktemp("xl-runs")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done: dict[tuple, Path] = {}

    def runs(method: str, ranks: int, *extra: str) -> Path:
        key = (method, ranks, *extra)
        if key not in done:
            out = root / f"{method}-{ranks}-{len(done)}"
            batch = 2 if ranks == 1 else 1
            # full fine-tuning keeps its latents on disk: the 2-rank run reads the 1-rank run's files
            cache = (f"--latent_cache_dir={root / 'latent-cache'}",) if method == "full" else ()
            args = xl_args(method, tiny_xl_model, xl_data[DATA[method]], out, *cache, *extra, batch=batch)
            (out.parent / f"{out.name}.log").write_text(train(args, env, ranks=ranks).stderr)
            done[key] = out
        return done[key]

    runs.env = env  # type: ignore[attr-defined]
    runs.root = root  # type: ignore[attr-defined]
    return runs


def initial_vectors(model: Path) -> dict[str, torch.Tensor]:
    """What the concept's vectors start as: the initializer's row of each text encoder's embedding table."""
    from transformers import CLIPTokenizer

    out = {}
    for key, sub in (("clip_l", "text_encoder"), ("clip_g", "text_encoder_2")):
        tok = CLIPTokenizer.from_pretrained(model, subfolder="tokenizer" if sub == "text_encoder" else "tokenizer_2")
        table = load_file(str(model / sub / "model.safetensors"))["text_model.embeddings.token_embedding.weight"]
        out[key] = table[tok.encode("toy", add_special_tokens=False)].clone()
    return out


@pytest.mark.parametrize("method", ["textual_inversion", "lora", "full"])
def test_two_ranks_learn_what_one_rank_with_double_batch_learns(method, xl_runs, tiny_xl_model):
    one, two = xl_runs(method, 1), xl_runs(method, 2)
    summary = json.loads((two / "train_summary.json").read_text())
    assert summary["family"] == "sdxl" and summary["resolution"] == 64 and summary["ranks"] == 2
    if method == "lora":
        a, b = load_file(str(one / LORA_FILE)), load_file(str(two / LORA_FILE))
        up = [k for k in a if "up" in k]  # lora_B starts at zero: its value is its update
        assert_same_training({k: a[k] for k in up}, {k: b[k] for k in up}, {k: torch.zeros_like(a[k]) for k in up})
    elif method == "textual_inversion":
        a, b = load_file(str(one / EMBEDS)), load_file(str(two / EMBEDS))
        assert_same_training(a, b, initial_vectors(tiny_xl_model))
    else:
        assert_same_training(unet_weights(one), unet_weights(two), unet_weights(tiny_xl_model))
        # the time ids are stored with each image's cached latents (80 x 80 images, no crop, trained at 64 px)
        assert "0 of 4 image(s) reused" in (one.parent / f"{one.name}.log").read_text()
        assert "4 of 4 image(s) reused, 0 encoded" in (two.parent / f"{two.name}.log").read_text()
        files = sorted((xl_runs.root / "latent-cache").glob("*.safetensors"))
        assert len(files) == 4
        assert all(load_file(str(f))["time_ids"].tolist() == [[80, 80, 0, 0, 64, 64]] * 2 for f in files)


def sdxl_image(pipe, prompt: str) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(0)
    return pipe(prompt, num_inference_steps=3, generator=g, height=64, width=64, output_type="pt").images[0]


def test_lora_loads_in_stock_sdxl_pipeline_and_changes_the_image(xl_runs, tiny_xl_model):
    from diffusers import StableDiffusionXLPipeline

    out = xl_runs("lora", 1)
    saved = load_file(str(out / LORA_FILE))
    assert {k.split(".", 1)[0] for k in saved} == {"unet", "text_encoder", "text_encoder_2"}
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_xl_model)
    base_unet = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
    before = sdxl_image(pipe, "a photo of toy")
    pipe.load_lora_weights(str(out), weight_name=LORA_FILE)  # (offline, diffusers wants the file's name)
    parts = (pipe.unet, pipe.text_encoder, pipe.text_encoder_2)
    assert {c.lora_alpha for m in parts for c in m.peft_config.values()} == {4}, "alpha not recorded"
    after = sdxl_image(pipe, "a photo of toy")
    assert (after - before).abs().mean() > 1e-3, "the adapter does not change the image"
    pipe.unload_lora_weights()
    assert all(torch.equal(v, base_unet[k]) for k, v in pipe.unet.state_dict().items())


def test_kohya_sdxl_lora_names_both_text_encoders_and_round_trips_to_diffusers(xl_runs, tiny_xl_model, tmp_path):
    """--save_format kohya on SDXL: lora_te1_ (text_encoder) and lora_te2_ (text_encoder_2), the names the UIs'
    SDXL loaders and diffusers read; the same training as the diffusers file; kohya -> diffusers keeps every
    tensor (alpha/rank folded into up, as documented)."""
    from diffusers import StableDiffusionXLPipeline

    from xeonsd.modelfiles.lora_layout import convert, module_names, read_adapter

    kohya = xl_runs("lora", 1, "--save_format=kohya") / LORA_FILE
    keys = list(load_file(str(kohya)))
    assert {k.split("_text_model_")[0] for k in keys if "_text_model_" in k} == {"lora_te1", "lora_te2"}, keys[:4]
    assert any(k.startswith("lora_unet_") for k in keys) and not any(k.startswith("lora_te_") for k in keys)

    ours, theirs = read_adapter(kohya), read_adapter(xl_runs("lora", 1) / LORA_FILE)
    assert ours.keys() == theirs.keys() and {m.alpha for m in ours.values()} == {4.0}
    ups = {n: torch.from_numpy(m.up) for n, m in ours.items()}
    assert_same_training(
        ups, {n: torch.from_numpy(m.up) for n, m in theirs.items()}, {n: 0 * u for n, u in ups.items()}
    )

    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_xl_model)
    names = module_names(pipe.unet, pipe.text_encoder, pipe.text_encoder_2)
    back = load_file(str(convert(kohya, tmp_path / LORA_FILE, "diffusers", names)))
    assert {k.split(".", 1)[0] for k in back} == {"unet", "text_encoder", "text_encoder_2"}
    for mod in ours.values():
        module = names[mod.name]
        part = "lora" if module.startswith("unet.") else "lora_linear_layer"
        assert torch.equal(back[f"{module}.{part}.down.weight"], torch.from_numpy(mod.down)), module
        assert torch.equal(back[f"{module}.{part}.up.weight"], torch.from_numpy(mod.up) * 2), module  # alpha 4 / rank 2
    pipe.load_lora_weights(str(kohya.parent), weight_name=LORA_FILE)  # diffusers' own kohya SDXL reader
    assert all(getattr(pipe, c).peft_config for c in ("unet", "text_encoder", "text_encoder_2"))


def test_embedding_loads_with_the_two_documented_calls_and_changes_the_image(xl_runs, tiny_xl_model):
    from diffusers import StableDiffusionXLPipeline

    from xeonsd.modelfiles.concept_file import ConceptError, load_concept, load_xl_concept

    path = xl_runs("textual_inversion", 1) / EMBEDS
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == ["clip_g", "clip_l"] and f.metadata()["token"] == "<dicoo>"
    concept = load_xl_concept(path)
    clip_l, clip_g = concept["text_encoder"], concept["text_encoder_2"]
    assert clip_l.tokens == clip_g.tokens == ["<dicoo>"] and clip_l.vectors.shape == (1, 32)
    with pytest.raises(ConceptError, match="is an SDXL concept"):
        load_concept(path)
    # the two calls of docs/trainer.md
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_xl_model)
    before = sdxl_image(pipe, "a photo of toy")  # the concept's vectors started as "toy"'s
    state = load_file(str(path))
    pipe.load_textual_inversion(
        state["clip_l"], token="<dicoo>", text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer
    )
    pipe.load_textual_inversion(
        state["clip_g"], token="<dicoo>", text_encoder=pipe.text_encoder_2, tokenizer=pipe.tokenizer_2
    )
    after = sdxl_image(pipe, "a photo of <dicoo>")
    assert (after - before).abs().mean() > 1e-4, "the learned concept does not change the image"


def test_resume_continues_the_same_trajectory(xl_runs, tiny_xl_model, xl_data, tmp_path):
    """Textual inversion resumed from its step-2 checkpoint ends where the 4-step run ends: the SDXL-specific state
    (the second encoder's vectors) round-trips. LoRA's and full's states are their parameter lists, the same code
    for every family (their SD resume tests cover it)."""
    full = xl_runs("textual_inversion", 1)
    part = tmp_path / "part"
    part.mkdir()
    shutil.copytree(full / "checkpoint-2", part / "checkpoint-2")
    args = xl_args(
        "textual_inversion", tiny_xl_model, xl_data["plain"], part, "--resume_from_checkpoint=latest", batch=2
    )
    proc = train(args, xl_runs.env)
    assert "resumed from" in proc.stderr
    a, b = load_file(str(full / EMBEDS)), load_file(str(part / EMBEDS))
    assert all(torch.equal(a[k], b[k]) for k in ("clip_l", "clip_g"))


def test_time_ids_follow_the_crop_and_the_mirror(tmp_path):
    from PIL import Image

    from xeonsd.families.sdxl.training import time_ids_for
    from xeonsd.trainer.latents import image_cache_key

    Image.new("RGB", (120, 80)).save(tmp_path / "wide.png")  # width 120, height 80
    squashed = time_ids_for(tmp_path / "wide.png", 64, center_crop=False)
    assert squashed.tolist() == [[80, 120, 0, 0, 64, 64]] * 2
    cropped = time_ids_for(tmp_path / "wide.png", 64, center_crop=True)
    # the centre 80 x 80 square starts at x = 20 of 120; in the image resized to a 64-px short side: 16
    assert cropped.tolist() == [[80, 120, 0, 16, 64, 64], [80, 120, 0, 16, 64, 64]]
    # part of the latent cache's key: SDXL's cached latents are never taken for other micro-conditioning
    keys = {image_cache_key(tmp_path / "wide.png", "vae", 64, True, t) for t in (None, squashed, cropped)}
    assert len(keys) == 3


# ---- the real SDXL architecture: its memory, from the config files alone -------------------------------------------


@pytest.fixture(scope="module")
def sdxl_configs(tiny_xl_model, tmp_path_factory) -> Path:
    """An SDXL base pipeline directory with the real architecture's config files and no weights."""
    from transformers import CLIPTextConfig

    from xeonsd.assets.models import _unet, _vae
    from xeonsd.families.sdxl.assets import ARCHS

    out = tmp_path_factory.mktemp("sdxl-configs") / "sdxl"
    out.mkdir()
    shutil.copy(tiny_xl_model / "model_index.json", out)
    for name in ("scheduler", "tokenizer", "tokenizer_2"):
        shutil.copytree(tiny_xl_model / name, out / name)
    with torch.device("meta"):
        _unet(ARCHS["sdxl"]).save_config(out / "unet")
        _vae(ARCHS["sdxl"]).save_config(out / "vae")
    encoders = {"text_encoder": (768, 12, 12, 3072, 768), "text_encoder_2": (1280, 32, 20, 5120, 1280)}
    for sub, (hidden, layers, heads, inter, proj) in encoders.items():
        CLIPTextConfig(
            vocab_size=49408,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=inter,
            projection_dim=proj,
        ).save_pretrained(out / sub)
    return out


def test_sdxl_defaults_to_1024_and_full_fine_tuning_does_not_fit_a_24_gb_node(sdxl_configs, tiny_xl_model, tiny_model):
    from xeonsd.families import detect_family
    from xeonsd.trainer.argv import parse_config
    from xeonsd.trainer.memory import GB, check_fits, estimate
    from xeonsd.trainer.resolution import with_resolution

    def cfg(model: Path, method: str, *extra: str):
        args = [a for a in method_args(method, model, Path("d"), Path("o")) if not a.startswith("--resolution")]
        return parse_config([*args, "--instance_prompt=x", "--mixed_precision=bf16", "--train_batch_size=1", *extra])

    models = (sdxl_configs, tiny_xl_model, tiny_model)
    resolutions = [with_resolution(cfg(m, "lora"), detect_family(m)).resolution for m in models]
    assert resolutions == [1024, 64, 64]  # sample_size × VAE scale: SDXL base's, tiny-xl's, tiny SD's
    full = estimate(cfg(sdxl_configs, "full"), "full", 5, 1)  # at the default, 1024 px
    assert full.gradients > 2.5e9 * 4 and full.optimizer == 2 * full.gradients  # fp32, for the 2.57 B UNet weights
    problem = check_fits(full, 1, int(24 * GB))
    assert problem and f"{full.total / GB:.1f} GB per rank" in problem and "24.0 GB free" in problem
    lora = estimate(cfg(sdxl_configs, "lora", "--resolution=512"), "lora", 5, 1)
    assert lora.activations < full.activations / 4 and check_fits(lora, 1, int(24 * GB)) is None
    print(f"SDXL estimate: full 1024 px {full.describe()}; LoRA 512 px {lora.describe()}")
    # Per node: 4 LoRA ranks with private copies need 4 x the rank's peak, which a 24 GB node does not have; with
    # the frozen weights shared (the bf16 UNet, VAE, both CLIPs) once per node they fit. Full fine-tuning shares
    # no UNet: its UNet trains.
    assert lora.shared_training > 2.5e9 * 2 and full.shared_loading < lora.shared_loading - 2.5e9 * 2
    private4, shared4 = lora.per_node(4, False), lora.per_node(4, True)
    print(f"SDXL LoRA 512 px, 4 ranks on a node: {private4 / GB:.1f} GB private, {shared4 / GB:.1f} GB shared")
    assert private4 == 4 * lora.total and shared4 < private4 - 3 * lora.shared_training + 1
    problem = check_fits(lora, 4, int(24 * GB))
    assert problem and "per rank x 4 rank(s)" in problem and check_fits(lora, 4, int(24 * GB), shared=True) is None


# ---- families that are refused --------------------------------------------------------------------------------------


def test_a_refiner_is_refused_before_any_weight_loads(tiny_xl_model, xl_data, tmp_path, cli_env):
    model = tmp_path / "refiner"
    shutil.copytree(tiny_xl_model, model)
    index = json.loads((model / "model_index.json").read_text())
    index.update(text_encoder=[None, None], tokenizer=[None, None], requires_aesthetics_score=True)
    (model / "model_index.json").write_text(json.dumps(index))
    err = refused(xl_args("full", model, xl_data["plain"], tmp_path / "o"), cli_env)
    last = err.strip().splitlines()[-1]
    assert last.startswith("xeonsd train: error: ") and "an SDXL refiner" in last and "supported: SD 1.x/2.x" in last
    assert "Loading weights" not in err and not (tmp_path / "o").exists()


def test_doctor_names_the_family_and_estimates_at_its_resolution(tiny_xl_model, xl_data, cli_env):

    args = [
        "--method=lora",
        f"--pretrained_model_name_or_path={tiny_xl_model}",
        f"--train_data_dir={xl_data['plain']}",
        "--instance_prompt=a photo of toy",
        "--mixed_precision=no",
        "--train_batch_size=1",
        "--output_dir=/nonexistent/run",
    ]
    proc = run_cli(["doctor", "--json", "--skip-train", "--", *args], cli_env, timeout=600)
    checks = {c["name"]: c for c in json.loads(proc.stdout.strip().splitlines()[-1])["checks"]}
    assert checks["model"]["status"] == "PASS" and checks["model"]["detail"].endswith("; SDXL"), checks["model"]
    assert checks["memory"]["status"] == "PASS" and " at 64 px" in checks["memory"]["detail"], checks["memory"]
