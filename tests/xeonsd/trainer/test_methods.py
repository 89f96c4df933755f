"""LoRA and full fine-tuning beside textual inversion, on the tiny models (SD 1.x and v-prediction SD 2.x style),
with captions in each layout, under real mpirun; and each bad input they add."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_runs import method_args, refused, run_cli, train
from safetensors.torch import load_file

from xeonsd.trainer.argv import build_parser

LORA_FILE = "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="session")
def tiny_v_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from xeonsd.assets import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("assets") / "tiny-v", arch="tiny-v")


@pytest.fixture(scope="session")
def captioned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same 5 images with captions in each layout."""
    from xeonsd.assets import make_dataset

    root = tmp_path_factory.mktemp("captioned")
    out = {}
    for layout in ("metadata", "sidecar", "txt"):
        make_dataset(root / layout, count=5, size=64, captions=layout)
        out[layout] = root / layout
    return out


def unet_weights(d: Path) -> dict[str, torch.Tensor]:
    return load_file(str(d / "unet" / "diffusion_pytorch_model.safetensors"))


def assert_same_training(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], base: dict[str, torch.Tensor], largest: float = 0.05
):
    """Two runs learned the same weights. Adam divides each gradient element by its own running RMS, so an element
    whose gradient is ~0 can move differently when only the order of the float additions in the all-reduce
    differs. Tolerance: the mean absolute difference is below 1e-4 of the mean update, the largest below
    ``largest`` (5 %) of the largest update."""
    diff = torch.cat([(a[k].float() - b[k].float()).abs().flatten() for k in a])
    update = torch.cat([(a[k].float() - base[k].float()).abs().flatten() for k in a])
    assert update.max() > 0, "nothing learned"
    assert diff.mean() < 1e-4 * update.mean(), (diff.mean(), update.mean())
    assert diff.max() < largest * update.max(), (diff.max(), update.max())


# ---- LoRA ----------------------------------------------------------------------------------------------------------


def test_lora_two_ranks_learn_what_one_rank_with_double_batch_learns(tiny_model, captioned, tmp_path, cli_env):
    one, two = tmp_path / "one", tmp_path / "two"
    train(method_args("lora", tiny_model, captioned["metadata"], one, batch=2), cli_env)
    proc = train(method_args("lora", tiny_model, captioned["metadata"], two), cli_env, ranks=2)
    assert "backend=gloo" in proc.stderr and "prompts: 5 from metadata.jsonl" in proc.stderr
    a, b = load_file(str(one / LORA_FILE)), load_file(str(two / LORA_FILE))
    assert a.keys() == b.keys()
    zero = {k: torch.zeros_like(v) for k, v in a.items()}
    # lora_B starts at zero, so the update of the "up" weights is their value
    assert_same_training(
        {k: a[k] for k in a if "up" in k}, {k: b[k] for k in b if "up" in k}, {k: zero[k] for k in a if "up" in k}
    )
    rows = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    n_adapter = sum(v.numel() for v in a.values())
    assert rows[0]["method"] == "lora" and rows[0]["allreduce_bytes"] == (n_adapter + 1) * 4


def test_the_fused_lora_forward_learns_what_peft_s_forward_learns(tiny_model, captioned, tmp_path, cli_env):
    """fp32, so the two forwards differ only in the order of their float operations (bf16: test_lora_layer.py)."""
    from xeonsd.trainer.argv import parse_config
    from xeonsd.trainer.methods.lora import unet_lora_config
    from xeonsd.trainer.methods.lora_layer import FusedLoraLinear

    fused, peft = tmp_path / "fused", tmp_path / "peft"
    train(method_args("lora", tiny_model, captioned["metadata"], fused, "--mixed_precision=no"), cli_env)
    train(
        method_args("lora", tiny_model, captioned["metadata"], peft, "--mixed_precision=no", "--no-fused_lora"), cli_env
    )
    a, b = load_file(str(fused / LORA_FILE)), load_file(str(peft / LORA_FILE))
    assert a.keys() == b.keys()
    ups = [k for k in a if "up" in k]
    assert_same_training({k: a[k] for k in ups}, {k: b[k] for k in ups}, {k: torch.zeros_like(a[k]) for k in ups})
    flags = [
        "--method=lora",
        f"--pretrained_model_name_or_path={tiny_model}",
        f"--train_data_dir={captioned['metadata']}",
    ]
    on, off = unet_lora_config(parse_config(flags)), unet_lora_config(parse_config([*flags, "--no-fused_lora"]))
    assert on._custom_modules == {torch.nn.Linear: FusedLoraLinear} and not off._custom_modules


def test_lora_file_loads_in_stock_diffusers_and_changes_the_image(tiny_model, dataset, tmp_path, cli_env):
    out = tmp_path / "lora"
    args = method_args(
        "lora",
        tiny_model,
        dataset,
        out,
        "--instance_prompt=a photo of toy",
        "--rank=2",
        "--lora_alpha=4",
        "--train_text_encoder",
        "--learning_rate=5e-2",
        steps=4,
    )
    proc = train(args, cli_env)
    assert "prompts: 1 from --instance_prompt" in proc.stderr
    saved = load_file(str(out / LORA_FILE))
    # only adapters: a down and an up matrix per targeted projection, on the UNet and the text encoder
    assert saved and all(".lora" in k for k in saved)
    unet_keys = [k for k in saved if k.startswith("unet.")]
    te_keys = [k for k in saved if k.startswith("text_encoder.")]
    assert {k.rsplit(".lora.", 1)[0].rsplit(".", 1)[-1] for k in unet_keys} == {"to_q", "to_k", "to_v", "0"}
    assert te_keys and all(t.shape[0] == 2 or t.shape[1] == 2 for t in saved.values())

    from diffusers import StableDiffusionPipeline

    def image(pipe) -> torch.Tensor:
        pipe.set_progress_bar_config(disable=True)
        g = torch.Generator().manual_seed(0)
        out = pipe("a photo of toy", num_inference_steps=3, generator=g, height=64, width=64, output_type="pt")
        return out.images[0]

    pipe = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None)
    base_unet = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
    before = image(pipe)
    pipe.load_lora_weights(str(out))
    # the file carries the adapters' alpha (4 with rank 2: scale 2), for diffusers and for the GenAI conversion
    assert {c.lora_alpha for c in (*pipe.unet.peft_config.values(), *pipe.text_encoder.peft_config.values())} == {4}
    from xeonsd.openvino.lora_files import read_adapter

    assert {m.alpha for m in read_adapter(out / LORA_FILE).values()} == {4.0}
    after = image(pipe)
    assert (after - before).abs().mean() > 1e-3, "the adapter does not change the image"
    pipe.unload_lora_weights()
    assert all(torch.equal(v, base_unet[k]) for k, v in pipe.unet.state_dict().items())


# ---- full fine-tuning ------------------------------------------------------------------------------------------------


def test_full_two_ranks_learn_what_one_rank_with_double_batch_learns(tiny_model, captioned, tmp_path, cli_env):
    one, two = tmp_path / "one", tmp_path / "two"
    train(method_args("full", tiny_model, captioned["sidecar"], one, batch=2), cli_env)
    proc = train(method_args("full", tiny_model, captioned["sidecar"], two, "--count_flops"), cli_env, ranks=2)
    assert "prompts: 5 from sidecar .txt files" in proc.stderr
    base = unet_weights(tiny_model)
    assert_same_training(unet_weights(one), unet_weights(two), base)
    # DistributedDataParallel's buckets, as the profiler recorded them on step 2: every UNet gradient, and the loss
    rows = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    n_unet = sum(v.numel() for v in base.values())
    assert rows[1]["allreduce_bytes_measured"] == rows[1]["allreduce_bytes"] == (n_unet + 1) * 4


def test_full_pipeline_differs_from_the_base_only_in_the_unet(tiny_model, dataset, tmp_path, cli_env):
    out = tmp_path / "full"
    args = method_args(
        "full",
        tiny_model,
        dataset,
        out,
        "--instance_prompt=a photo of toy",
        "--use_ema",
        "--ema_decay=0.5",
        "--gradient_checkpointing",
        "--max_grad_norm=0.5",
        "--mixed_precision=bf16",
    )
    train(args, cli_env)
    from diffusers import StableDiffusionPipeline

    base = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None)
    tuned = StableDiffusionPipeline.from_pretrained(out, safety_checker=None)
    for name in ("text_encoder", "vae"):
        b, t = getattr(base, name).state_dict(), getattr(tuned, name).state_dict()
        assert all(torch.equal(b[k], t[k]) for k in b), f"{name} changed"
    assert tuned.tokenizer.get_vocab() == base.tokenizer.get_vocab()
    b, t = base.unet.state_dict(), tuned.unet.state_dict()
    assert any(not torch.equal(b[k], t[k]) for k in b), "the UNet did not learn"
    assert all(t[k].dtype == torch.float32 for k in t), "the saved UNet is not the fp32 master copy"


# ---- every method: resume, v-prediction, captions ------------------------------------------------------------------


@pytest.mark.parametrize("method", ["lora", "full"])
def test_resume_continues_the_same_trajectory(method, tiny_model, dataset, tmp_path, cli_env):
    """A run resumed from its step-3 checkpoint ends exactly where the uninterrupted 6-step run ends."""
    full, part = tmp_path / "full", tmp_path / "part"
    extra = ("--instance_prompt=a photo of toy",)
    train(method_args(method, tiny_model, dataset, full, *extra, "--checkpointing_steps=3", steps=6), cli_env)
    assert sorted(p.name for p in full.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    part.mkdir()
    shutil.copytree(full / "checkpoint-3", part / "checkpoint-3")
    proc = train(
        method_args(method, tiny_model, dataset, part, *extra, "--resume_from_checkpoint=latest", steps=6), cli_env
    )
    assert "resumed from" in proc.stderr
    if method == "lora":
        a, b = load_file(str(full / LORA_FILE)), load_file(str(part / LORA_FILE))
    else:
        a, b = unet_weights(full), unet_weights(part)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("method", ["textual_inversion", "lora", "full"])
def test_v_prediction_model_trains_with_each_method(method, tiny_v_model, captioned, tmp_path, cli_env):
    out = tmp_path / "out"
    train(method_args(method, tiny_v_model, captioned["txt"], out), cli_env)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["loss"] > 0 for r in rows)
    from diffusers import DDPMScheduler

    assert DDPMScheduler.from_pretrained(tiny_v_model, subfolder="scheduler").config.prediction_type == "v_prediction"


def test_textual_inversion_trains_on_captions_with_the_placeholder(tiny_model, captioned, tmp_path, cli_env):
    out = tmp_path / "ti"
    proc = train(method_args("textual_inversion", tiny_model, captioned["txt"], out), cli_env)
    assert "prompts: 5 from captions.txt" in proc.stderr
    off = tmp_path / "off"
    proc = train(method_args("textual_inversion", tiny_model, captioned["txt"], off, "--captions=off"), cli_env)
    assert "prompts: 27 from object templates" in proc.stderr
    a = load_file(str(out / "learned_embeds.safetensors"))["<dicoo>"]
    b = load_file(str(off / "learned_embeds.safetensors"))["<dicoo>"]
    assert not torch.equal(a, b), "the captions made no difference"


def test_latent_cache_dir_is_reused_and_gives_the_same_run(tiny_model, dataset, tmp_path, cli_env):
    cache = tmp_path / "cache"
    first, second = tmp_path / "a", tmp_path / "b"
    extra = ("--instance_prompt=a photo of toy", f"--latent_cache_dir={cache}")
    proc = train(method_args("lora", tiny_model, dataset, first, *extra), cli_env)
    assert "0 of 5 image(s) reused, 5 encoded" in proc.stderr
    assert len(list(cache.glob("*.safetensors"))) == 5
    proc = train(method_args("lora", tiny_model, dataset, second, *extra), cli_env)
    assert "5 of 5 image(s) reused, 0 encoded" in proc.stderr
    a, b = load_file(str(first / LORA_FILE)), load_file(str(second / LORA_FILE))
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---- the command line and bad input ----------------------------------------------------------------------------------


def test_help_groups_the_flags_by_method():
    text = build_parser().format_help()
    sections = [
        "textual inversion (--method textual_inversion)",
        "LoRA (--method lora)",
        "full fine-tuning of the UNet (--method full)",
    ]
    positions = [text.index(s) for s in sections]
    assert positions[0] < text.index("\n  --placeholder_token") < positions[1]
    assert positions[1] < text.index("\n  --rank") < positions[2]
    assert text.index("\n  --use_ema") > positions[2]


def test_flags_of_another_method_are_refused(tiny_model, dataset, tmp_path, cli_env):
    err = refused(method_args("textual_inversion", tiny_model, dataset, tmp_path / "o", "--rank=8"), cli_env)
    assert "--method textual_inversion does not use --rank (a lora flag)" in err
    err = refused(
        method_args(
            "lora", tiny_model, dataset, tmp_path / "o", "--instance_prompt=x", "--placeholder_token=<x>", "--use_ema"
        ),
        cli_env,
    )
    assert "--placeholder_token (a textual_inversion flag)" in err and "--use_ema (a full flag)" in err


def test_rank_below_one(tiny_model, dataset, tmp_path, cli_env):
    err = refused(method_args("lora", tiny_model, dataset, tmp_path / "o", "--instance_prompt=x", "--rank=0"), cli_env)
    assert "--rank must be at least 1, got 0" in err


def test_lora_without_captions_or_instance_prompt(tiny_model, dataset, tmp_path, cli_env):
    err = refused(method_args("lora", tiny_model, dataset, tmp_path / "o"), cli_env)
    assert "needs --instance_prompt" in err


def test_caption_without_the_placeholder_is_named(tiny_model, captioned, tmp_path, cli_env):
    data = tmp_path / "d"
    shutil.copytree(captioned["txt"], data)
    lines = (data / "captions.txt").read_text().splitlines()
    lines[2] = "a photo of a robot"
    (data / "captions.txt").write_text("\n".join(lines) + "\n")
    err = refused(method_args("textual_inversion", tiny_model, data, tmp_path / "o"), cli_env)
    assert "captions.txt:3 (dicoo_02.png)" in err and "'a photo of a robot'" in err and "<dicoo>" in err


def test_caption_count_mismatch_names_both_counts(tiny_model, captioned, tmp_path, cli_env):
    data = tmp_path / "d"
    shutil.copytree(captioned["txt"], data)
    (data / "captions.txt").write_text("a <dicoo>\n")
    err = refused(method_args("lora", tiny_model, data, tmp_path / "o"), cli_env)
    assert "1 caption line(s)" in err and "5 image(s)" in err
    assert not (tmp_path / "o").exists(), "a refused run wrote something"


def test_checkpoint_of_another_method_or_base_model_is_refused(tiny_model, tiny_v_model, dataset, tmp_path, cli_env):
    out = tmp_path / "o"
    train(
        method_args("lora", tiny_model, dataset, out, "--instance_prompt=x", "--checkpointing_steps=2", steps=2),
        cli_env,
    )
    before = (out / LORA_FILE).read_bytes()
    err = refused(
        method_args("full", tiny_model, dataset, out, "--instance_prompt=x", "--resume_from_checkpoint=latest"), cli_env
    )
    assert "checkpoint-2 is a lora run's; this run is --method full" in err
    err = refused(
        method_args("lora", tiny_v_model, dataset, out, "--instance_prompt=x", "--resume_from_checkpoint=latest"),
        cli_env,
    )
    assert "was trained on another base model" in err
    assert (out / LORA_FILE).read_bytes() == before


def test_resume_latest_without_a_checkpoint_is_refused_unless_asked(tiny_model, dataset, tmp_path, cli_env):
    out = tmp_path / "o"
    err = refused(
        method_args("lora", tiny_model, dataset, out, "--instance_prompt=x", "--resume_from_checkpoint=latest"), cli_env
    )
    assert f"{out} holds no checkpoint" in err
    proc = train(
        method_args(
            "lora", tiny_model, dataset, out, "--instance_prompt=x", "--resume_from_checkpoint=latest_if_any", steps=1
        ),
        cli_env,
    )
    assert "resumed from" not in proc.stderr and (out / LORA_FILE).exists()
    # a finished run without checkpoints is not overwritten by 'resume if possible'
    err = refused(
        method_args("lora", tiny_model, dataset, out, "--instance_prompt=x", "--resume_from_checkpoint=latest_if_any"),
        cli_env,
    )
    assert "already holds a run" in err


# ---- memory --------------------------------------------------------------------------------------------------------


def test_dry_run_prints_the_memory_estimate_and_writes_nothing(tiny_model, dataset, tmp_path, cli_env):
    out = tmp_path / "o"
    proc = run_cli(
        ["train", *method_args("full", tiny_model, dataset, out, "--instance_prompt=x", "--dry-run")], cli_env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("estimated peak memory per rank"))
    for part in ("weights", "gradients", "optimizer", "activations", "GB free"):
        assert part in line
    assert not out.exists()


def test_the_estimate_counts_glibc_malloc_s_keep_and_none_under_tcmalloc(tiny_model, dataset, tmp_path, cli_env):
    """Without tcmalloc preloaded the estimate adds a quarter of the activations (glibc's malloc keeps that much
    beyond the live bytes, measured); with it preloaded, as the cluster's env.sh does, nothing."""
    from xeonsd.trainer.memory import ESTIMATE_FILE, GLIBC_ACTIVATION_SHARE

    libs = sorted(Path("/usr/lib/x86_64-linux-gnu").glob("libtcmalloc.so.*"))
    assert libs, "tcmalloc (libgoogle-perftools4) is not installed: .ci/run installs it"
    found = {}
    for name, env in (("glibc", cli_env), ("tcmalloc", dict(cli_env, LD_PRELOAD=str(libs[0])))):
        out = tmp_path / name
        args = method_args("lora", tiny_model, dataset, out, "--instance_prompt=x", "--max_train_steps=1")
        proc = run_cli(["train", *args], env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        found[name] = json.loads((out / ESTIMATE_FILE).read_text())
    glibc, tcmalloc = found["glibc"], found["tcmalloc"]
    assert tcmalloc["allocator"] == 0 and glibc["activations"] == tcmalloc["activations"] > 0
    assert glibc["allocator"] == int(GLIBC_ACTIVATION_SHARE * glibc["activations"])
    assert glibc["training"] - tcmalloc["training"] - glibc["allocator"] == glibc["runtime"] - tcmalloc["runtime"]


def test_estimate_grows_with_what_the_method_trains_and_the_resolution(tiny_model):
    from xeonsd.trainer.argv import parse_config
    from xeonsd.trainer.memory import estimate

    def est(method: str, *extra: str):
        args = method_args(method, tiny_model, Path("d"), Path("o"), *extra)
        if method != "textual_inversion":
            args.append("--instance_prompt=x")
        return estimate(parse_config(args), method, 5, 1)

    ti, lora, full = est("textual_inversion"), est("lora"), est("full")
    n_unet = sum(v.numel() for v in unet_weights(tiny_model).values())
    assert full.gradients == n_unet * 4 and full.optimizer == n_unet * 8  # fp32 grads, AdamW's two moments
    assert 0 < lora.gradients < full.gradients / 10 and ti.gradients == 32 * 4
    assert est("lora", "--resolution=128").activations > 1.5 * lora.activations  # 4x the pixels
    assert est("full", "--gradient_checkpointing").activations < full.activations


def test_a_run_that_cannot_fit_in_memory_is_refused_naming_both_figures(tiny_model, dataset, tmp_path, cli_env):
    args = method_args(
        "lora",
        tiny_model,
        dataset,
        tmp_path / "o",
        "--instance_prompt=x",
        "--resolution=4096",
        "--train_batch_size=512",
    )
    err = refused(args, cli_env)
    assert "the estimated peak memory is" in err and "GB free (MemAvailable)" in err
    assert not (tmp_path / "o").exists()
