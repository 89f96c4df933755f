"""The rectified-flow objective of FLUX.1 and SD3 against diffusers' own definitions (the scheduler's σ grid and
FLUX's resolution-dependent shift, the density and loss weights of its training utilities, FLUX's latent packing);
the flags a flow model refuses; and the memory estimate of the real FLUX.1-dev and SD3.5-medium architectures from
their config files alone (no weights)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_runs import method_args, refused

from xeonsd.cluster.launch import RankInfo
from xeonsd.trainer.argv import parse_config
from xeonsd.trainer.config import ConfigError
from xeonsd.trainer.flow import FlowSchedule


def schedule(scheme: str, **config) -> FlowSchedule:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowSchedule.from_config(FlowMatchEulerDiscreteScheduler(**config).config, scheme, 0.0, 1.0, 1.29)


def test_sigma_is_the_schedulers_training_grid_with_its_shift():
    """σ(u) is the scheduler's own sigmas at index ⌊u·N⌋ (what diffusers' scripts index), SD3's static shift 3."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sd3 = FlowMatchEulerDiscreteScheduler(shift=3.0)
    s = schedule("none", shift=3.0)
    for u in (0.0, 0.1234, 0.5, 0.999):
        index = int(u * 1000)
        assert s.sigma(u, (16, 64, 64)) == pytest.approx(float(sd3.sigmas[index]), abs=1e-6)
    assert s.sigma(0.5, (16, 64, 64)) != pytest.approx(0.5)  # shifted toward noise


def test_flux_shift_follows_the_token_count_as_its_pipeline_computes_it():
    """FLUX.1's use_dynamic_shifting: mu from the packed token count (FluxPipeline's calculate_shift), then the
    scheduler's exponential time shift of the unshifted grid; 1024 px shifts more than 512 px."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    config = dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256)
    config["max_image_seq_len"] = 4096
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, **config)
    s = schedule("none", shift=3.0, **config)
    sigmas = {}
    for side in (64, 128):  # 512 px and 1024 px latents: 1024 and 4096 tokens
        mu = calculate_shift(side * side // 4, 256, 4096, 0.5, 1.15)
        expected = scheduler.time_shift(mu, 1.0, torch.tensor(0.5))
        sigmas[side] = s.sigma(0.5, (16, side, side))
        assert sigmas[side] == pytest.approx(float(expected), abs=1e-6)
    assert 0.5 < sigmas[64] < sigmas[128]


@pytest.mark.parametrize("scheme", ["sigma_sqrt", "cosmap", "none", "logit_normal"])
def test_loss_weights_and_densities_are_diffusers(scheme):
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    s = schedule(scheme)
    sigmas = torch.tensor([0.1, 0.4, 0.9])
    assert torch.allclose(s.weights(sigmas), compute_loss_weighting_for_sd3(scheme, sigmas).float())
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert s.draw_u(g1) == pytest.approx(
        float(compute_density_for_timestep_sampling(scheme, 1, 0.0, 1.0, 1.29, generator=g2)[0])
    )


def test_flux_packing_and_position_ids_are_the_pipelines():
    from diffusers import FluxPipeline

    from xeonsd.families.flux.training import image_ids, pack, unpack

    x = torch.randn(2, 16, 6, 8)
    packed = FluxPipeline._pack_latents(x, 2, 16, 6, 8)
    assert torch.equal(pack(x), packed)
    assert torch.equal(unpack(packed, 6, 8), x)
    assert torch.equal(
        image_ids(6, 8, torch.float32), FluxPipeline._prepare_latent_image_ids(2, 3, 4, "cpu", torch.float32)
    )


def test_the_sigma_of_an_example_is_a_function_of_seed_and_global_index():
    from xeonsd.trainer.data import SamplingPlan

    plan = SamplingPlan(seed=5, num_images=3, num_templates=1, num_timesteps=1000, latent_shape=(16, 8, 8))
    flow = SamplingPlan(**{**plan.__dict__, "flow": schedule("logit_normal")})
    a, b = flow.example(7), flow.example(7)
    assert a.sigma == b.sigma and 0 < a.sigma < 1 and flow.example(8).sigma != a.sigma
    # its own stream: the other draws are those of a plan without σ
    plain = plan.example(7)
    assert torch.equal(a.noise, plain.noise) and a.input_id == plain.input_id and plain.sigma is None


# ---- what a flow model refuses --------------------------------------------------------------------------------------


def validate_args(model: Path, data: Path, tmp: Path, method: str, *extra: str):
    from xeonsd.trainer.inputs import validate

    args = [a for a in method_args(method, model, data, tmp / "o") if not a.startswith("--resolution")]
    cfg = parse_config([*args, *extra])
    return validate(cfg, RankInfo(0, 1, 0, 1, "single"))


@pytest.mark.parametrize(
    ("family", "flags", "says"),
    [
        (
            "flux",
            ["--snr_gamma=5"],
            "--snr_gamma is an ε/v-prediction option(s), but FLUX.1 trains with rectified flow",
        ),
        ("sd3", ["--noise_offset=0.1"], "choose how σ is drawn and weighted with --weighting_scheme"),
        ("flux", ["--resolution=72"], "--resolution must be a multiple of 16 for FLUX.1"),
        ("sd3", ["--weighting_scheme=cosine"], "--weighting_scheme 'cosine': choose one of logit_normal, mode"),
        ("flux", ["--buckets", "--bucket_reso_steps=8"], "--bucket_reso_steps must be a multiple of 16"),
    ],
)
def test_flow_models_refuse_the_noise_prediction_tools(
    family, flags, says, tiny_flux_model, tiny_sd3_model, dataset, tmp_path
):
    model = tiny_flux_model if family == "flux" else tiny_sd3_model
    with pytest.raises(ConfigError) as exc:
        validate_args(model, dataset, tmp_path, "lora", "--instance_prompt=a toy", *flags)
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_flow_flags_are_refused_on_a_unet_model(tiny_model, dataset, tmp_path):
    with pytest.raises(ConfigError, match="--weighting_scheme apply to the rectified-flow models"):
        validate_args(tiny_model, dataset, tmp_path, "lora", "--instance_prompt=a toy", "--weighting_scheme=mode")


def test_textual_inversion_is_refused_on_flux_in_one_line(tiny_flux_model, dataset, tmp_path, cli_env):
    args = [
        a for a in method_args("textual_inversion", tiny_flux_model, dataset, tmp_path / "o") if "resolution" not in a
    ]
    err = refused(args, cli_env)
    last = err.strip().splitlines()[-1]
    assert last.startswith("xeonsd train: error: --method textual_inversion is not supported on FLUX.1"), last
    assert "use --method lora or full" in last and not (tmp_path / "o").exists()


# ---- the real architectures' memory, from the config files alone ----------------------------------------------------


def _configs(arch: str, tiny: Path, out: Path) -> Path:
    """A pipeline directory of ``arch``'s real architecture with config files and no weights."""
    from transformers import CLIPTextConfig, T5Config

    from xeonsd.assets.flow_models import _vae
    from xeonsd.assets.models import family_archs

    family, a = family_archs()[arch]
    out.mkdir()
    shutil.copy(tiny / "model_index.json", out)
    shutil.copytree(tiny / "scheduler", out / "scheduler")
    with torch.device("meta"):
        family.assets.transformer(a).save_config(out / "transformer")
        _vae(a).save_config(out / "vae")
    clips = [a.clip_l] + ([a.clip_g] if a.clip_g else [])
    for i, c in enumerate(clips):
        CLIPTextConfig(
            vocab_size=49408,
            hidden_size=c.hidden,
            num_hidden_layers=c.layers,
            num_attention_heads=c.heads,
            intermediate_size=c.intermediate,
            projection_dim=c.hidden,
        ).save_pretrained(out / ("text_encoder" if i == 0 else "text_encoder_2"))
    t5 = out / f"text_encoder_{len(clips) + 1}"
    T5Config(
        vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, feed_forward_proj="gated-gelu"
    ).save_pretrained(t5)
    tok = out / f"tokenizer_{len(clips) + 1}"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text(json.dumps({"model_max_length": a.t5.max_length}))
    return out


@pytest.fixture(scope="module")
def real_configs(tiny_flux_model, tiny_sd3_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("flow-configs")
    return {
        "flux": _configs("flux", tiny_flux_model, root / "flux"),
        "sd35m": _configs("sd35m", tiny_sd3_model, root / "sd35m"),
    }


def test_flux_and_sd35_medium_memory_on_a_24_gb_node(real_configs):
    """At 512 px, bf16, on a 24 GB node: FLUX.1 (11.9 B transformer) is refused for full fine-tuning (its fp32
    weights, gradients and AdamW state) and for LoRA too (its bf16 weights alone are ~24 GB), each naming both
    figures; SD3.5-medium LoRA fits. T5 (4.7 B) counts in the loading peak, not in training (it is freed)."""
    from xeonsd.families import detect_family
    from xeonsd.trainer.memory import GB, check_fits, estimate
    from xeonsd.trainer.resolution import with_resolution

    def cfg(model: Path, method: str, *extra: str):
        args = [a for a in method_args(method, model, Path("d"), Path("o")) if not a.startswith("--resolution")]
        return parse_config([*args, "--instance_prompt=x", "--mixed_precision=bf16", "--train_batch_size=1", *extra])

    assert with_resolution(cfg(real_configs["flux"], "lora"), detect_family(real_configs["flux"])).resolution == 1024
    node = int(24 * GB)
    rows = {
        (arch, method): estimate(cfg(real_configs[arch], method, "--resolution=512"), method, 5, 1)
        for arch, method in (("flux", "full"), ("flux", "lora"), ("sd35m", "lora"))
    }
    for (arch, method), est in rows.items():
        print(f"{arch} {method} 512 px: {est.describe()}")
    for key in (("flux", "full"), ("flux", "lora")):
        est = rows[key]
        problem = check_fits(est, 1, node)
        assert problem and f"{est.total / GB:.1f} GB per rank" in problem and "24.0 GB free" in problem, key
    full, lora = rows["flux", "full"], rows["flux", "lora"]
    assert full.gradients > 11e9 * 4 and full.optimizer == 2 * full.gradients  # fp32, every transformer weight
    assert lora.weights > 22e9 and lora.training < 64 * GB  # the bf16 transformer; a 64 GB node trains it
    sd35 = rows["sd35m", "lora"]
    whole = estimate(cfg(real_configs["sd35m"], "lora", "--resolution=512", "--no-phased_loading"), "lora", 5, 1)
    print(f"sd35m lora 512 px, every model loaded at once: {whole.describe()}")
    # training fits; T5-XXL (bf16, 9.5 GB) is in the loading peak only, and loaded in phases it never sits beside
    # the transformer. (This directory has no weight files, so the loading figures are the pessimistic
    # from_pretrained ones: fp32 as stored plus the cast copy.)
    assert sd35.training < 0.6 * node and whole.loading - sd35.training > 9e9
    assert sd35.loading < whole.loading - 9e9
