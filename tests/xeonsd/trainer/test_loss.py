"""The loss and noise options of every method: min-SNR-γ weighting for ε and v prediction, the timesteps' range,
offset noise; their draws stay functions of (seed, global example index), and with the options off the plan draws
exactly what it drew before them."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from cli_runs import method_args, refused, train

from xeonsd.trainer.data import SamplingPlan
from xeonsd.trainer.loss import denoising_loss, min_snr_weights, parse_timestep_range, snr
from xeonsd.trainer.rng import Stream, generator

SHAPE = (4, 8, 8)


def ddpm(prediction_type: str):
    from diffusers import DDPMScheduler

    return DDPMScheduler.from_config(
        {
            "num_train_timesteps": 1000,
            "beta_start": 0.00085,
            "beta_end": 0.012,
            "beta_schedule": "scaled_linear",
            "prediction_type": prediction_type,
        }
    )


def plan(**kw) -> SamplingPlan:
    return SamplingPlan(seed=7, num_images=5, num_templates=3, num_timesteps=1000, latent_shape=SHAPE, **kw)


# ---- min-SNR-γ -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_min_snr_weights_are_the_papers_formula(prediction_type) -> None:
    from diffusers.training_utils import compute_snr

    sched = ddpm(prediction_type)
    t = torch.tensor([0, 10, 100, 400, 700, 999])
    ac = sched.alphas_cumprod.double()[t]
    s = ac / (1 - ac)
    assert torch.allclose(snr(sched.alphas_cumprod, t), s)
    assert torch.allclose(snr(sched.alphas_cumprod, t).float(), compute_snr(sched, t))  # diffusers' own SNR
    gamma = 5.0
    w = min_snr_weights(sched.alphas_cumprod, t, gamma, prediction_type)
    expected = torch.minimum(s, torch.full_like(s, gamma)) / (s if prediction_type == "epsilon" else s + 1)
    assert torch.allclose(w, expected)
    assert (w[:2] < 1).all() and w[-1] == pytest.approx(1.0 if prediction_type == "epsilon" else s[-1] / (s[-1] + 1))


def test_the_weighted_loss_is_the_mean_of_each_examples_weighted_mse_and_a_large_gamma_is_plain_mse() -> None:
    sched = ddpm("epsilon")
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(3, *SHAPE, generator=g), torch.randn(3, *SHAPE, generator=g)
    t = torch.tensor([5, 300, 900])
    plain = denoising_loss(pred, target, t)
    assert torch.equal(plain, F.mse_loss(pred, target))
    per_example = ((pred - target) ** 2).mean(dim=(1, 2, 3))
    w = min_snr_weights(sched.alphas_cumprod, t, 2.0, "epsilon")
    weighted = denoising_loss(pred, target, t, snr_gamma=2.0, alphas_cumprod=sched.alphas_cumprod)
    assert torch.allclose(weighted, (per_example * w.float()).mean())
    assert weighted < plain  # the low-t example (SNR >> 2) weighs less
    large = denoising_loss(pred, target, t, snr_gamma=1e9, alphas_cumprod=sched.alphas_cumprod)
    assert torch.allclose(large, plain)


def test_a_zero_terminal_snr_is_weight_one_not_nan() -> None:
    ac = torch.tensor([0.99, 0.5, 0.0])
    w = min_snr_weights(ac, torch.tensor([0, 1, 2]), 5.0, "epsilon")
    assert torch.allclose(w.float(), torch.tensor([5.0 / 99.0, 1.0, 1.0]))
    assert min_snr_weights(ac, torch.tensor([2]), 5.0, "v_prediction").item() == 0.0


# ---- the plan's draws ----------------------------------------------------------------------------------------------


def todays_example(p: SamplingPlan, k: int):
    """The plan's per-example draws as they were before the loss options (the order every run relies on)."""
    g = generator(p.seed, Stream.EXAMPLE, k)
    flip = bool(torch.rand((), generator=g) < p.flip_p)
    template = int(torch.randint(p.num_templates, (), generator=g))
    timestep = int(torch.randint(p.num_timesteps, (), generator=g))
    noise = torch.randn(p.latent_shape, generator=g)
    eps = torch.randn(p.latent_shape, generator=g)
    return 2 * p.image_for(k) + int(flip), template, timestep, noise, eps


def test_with_the_options_off_the_plan_draws_exactly_what_it_drew_before() -> None:
    p = plan()
    for k in (0, 1, 7, 123, 10_001):
        e = p.example(k)
        input_id, template, timestep, noise, eps = todays_example(p, k)
        assert (e.input_id, e.template, e.timestep) == (input_id, template, timestep)
        assert torch.equal(e.noise, noise) and torch.equal(e.latent_eps, eps)
    assert p.example(5).timestep == plan(timestep_range=None, noise_offset=0.0).example(5).timestep


def test_timestep_range_draws_stay_in_range_and_are_a_function_of_seed_and_index() -> None:
    p = plan(timestep_range=(100, 900))
    steps = [p.example(k).timestep for k in range(400)]
    assert min(steps) >= 100 and max(steps) < 900 and len(set(steps)) > 200
    assert steps == [plan(timestep_range=(100, 900)).example(k).timestep for k in range(400)]
    # the same examples whichever rank draws them: 2 ranks x batch 2 == 1 rank x batch 4
    one = p.batch(3, 0, 1, 1, 0, 4)
    two = p.batch(3, 0, 1, 2, 0, 2) + p.batch(3, 0, 1, 2, 1, 2)
    assert [e.timestep for e in one] == [e.timestep for e in two]
    assert all(e.timestep == 100 for e in (plan(timestep_range=(100, 101)).example(k) for k in range(20)))
    # the whole range given explicitly draws what the default draws
    assert [plan(timestep_range=(0, 1000)).example(k).timestep for k in range(50)] == [
        plan().example(k).timestep for k in range(50)
    ]
    # the other draws are the unranged plan's
    base = plan().example(42)
    assert torch.equal(p.example(42).noise, base.noise) and p.example(42).input_id == base.input_id


def test_noise_offset_adds_a_per_channel_constant_drawn_after_the_others() -> None:
    off, on = plan(), plan(noise_offset=0.1)
    for k in (0, 9, 77):
        a, b = off.example(k), on.example(k)
        delta = b.noise - a.noise
        assert torch.allclose(delta, delta[:, :1, :1].expand_as(delta), atol=1e-6)  # constant over h, w
        assert delta[:, 0, 0].abs().min() > 0 and delta[:, 0, 0].unique().numel() == SHAPE[0]
        g = generator(
            7, Stream.EXAMPLE, k
        )  # the plan's draws in their order (flip, template, timestep, noise, latent eps) ...
        torch.rand((), generator=g), torch.randint(3, (), generator=g), torch.randint(1000, (), generator=g)
        torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)
        # ... then the offset, [C, 1, 1]
        assert torch.allclose(delta[:, 0, 0], 0.1 * torch.randn((SHAPE[0], 1, 1), generator=g).flatten())
        assert torch.equal(a.latent_eps, b.latent_eps)
        assert (a.input_id, a.template, a.timestep) == (b.input_id, b.template, b.timestep)
    assert torch.equal(on.example(9).noise, plan(noise_offset=0.1).example(9).noise)


# ---- the flags -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["5", "a,b", "1,2,3", "-1,10", "500,500", "900,100", "0,1001"])
def test_bad_timestep_ranges_are_refused_with_the_flag_and_range_named(value) -> None:
    from xeonsd.trainer.config import ConfigError

    with pytest.raises(ConfigError, match=r"--timestep_range .*0 <= lo < hi <= 1000"):
        parse_timestep_range(value, 1000)
    assert parse_timestep_range("0,1000", 1000) == (0, 1000) and parse_timestep_range(None, 1000) is None


def test_bad_loss_flags_exit_2_naming_the_flag(tiny_model, dataset, tmp_path, cli_env) -> None:
    n = json.loads((tiny_model / "scheduler" / "scheduler_config.json").read_text()).get("num_train_timesteps", 1000)
    err = refused(
        method_args("textual_inversion", tiny_model, dataset, tmp_path / "o", f"--timestep_range=0,{n + 1}"), cli_env
    )
    assert f"--timestep_range '0,{n + 1}': expected two integers lo,hi with 0 <= lo < hi <= {n}" in err
    err = refused(
        method_args("lora", tiny_model, dataset, tmp_path / "o", "--instance_prompt=x", "--timestep_range=9,3"), cli_env
    )
    assert "--timestep_range '9,3'" in err
    err = refused(method_args("textual_inversion", tiny_model, dataset, tmp_path / "o", "--snr_gamma=0"), cli_env)
    assert "--snr_gamma must be positive" in err


# ---- tiny runs -----------------------------------------------------------------------------------------------------

OPTIONS = ("--snr_gamma=5", "--noise_offset=0.05", "--timestep_range=100,900")


@pytest.mark.parametrize("method", ["textual_inversion", "lora"])
def test_a_run_with_every_loss_option_finishes_and_records_them(method, tiny_model, dataset, tmp_path, cli_env) -> None:
    out = tmp_path / "out"
    extra = ("--instance_prompt=a photo of sks toy",) if method == "lora" else ()
    proc = train(method_args(method, tiny_model, dataset, out, *extra, *OPTIONS), cli_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["loss"] == {"snr_gamma": 5.0, "noise_offset": 0.05, "timestep_range": [100, 900]}
    assert (out / summary["result"]["path"]).is_file()
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert [r for r in rows if "loss" in r] and all(r["loss"] == r["loss"] for r in rows if "loss" in r)  # no NaN
