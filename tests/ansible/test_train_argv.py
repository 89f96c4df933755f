"""finetune_method: the inventory's `xeonsd train` argument list carries the chosen method's flags and no other
method's (the trainer refuses those), rendered by Ansible from inventory/group_vars/all/finetune.yml."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml
from repo_code import REPO, VENV_BIN, ansible_code

xeonsd_train = ansible_code("xeonsd_train")
TrainArgvError, train_argv = xeonsd_train.TrainArgvError, xeonsd_train.train_argv


def _inventory_argv(*extra_vars: str) -> list[str]:
    """finetune_train_argv as Ansible renders it from the repository's inventory, for the implicit localhost."""
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    args = [a for v in extra_vars for a in ("-e", v)]
    proc = subprocess.run(
        [
            str(VENV_BIN / "ansible"),
            "localhost",
            "-i",
            "inventory",
            "-m",
            "ansible.builtin.debug",
            "-a",
            "var=finetune_train_argv",
            *args,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The ad-hoc output: "localhost | SUCCESS => {...}"
    return json.loads(proc.stdout.split("=>", 1)[1])["finetune_train_argv"]


@pytest.mark.parametrize(
    ("method", "own", "foreign"),
    [
        (
            "textual_inversion",
            {"placeholder_token": "<dicoo>", "initializer_token": "toy"},
            ("rank", "instance_prompt"),
        ),
        (
            "lora",
            {"rank": 4, "instance_prompt": "a photo of a <dicoo> toy", "learning_rate": 1e-4},
            ("placeholder_token", "use_ema", "save_as_full_pipeline"),
        ),
        (
            "full",
            {"use_ema": True, "instance_prompt": "a photo of a <dicoo> toy", "learning_rate": 1e-5},
            ("placeholder_token", "rank", "lora_target_modules"),
        ),
    ],
)
def test_the_inventorys_argv_carries_only_the_chosen_methods_flags(method, own, foreign) -> None:
    from xeonsd.trainer.argv import given_flags, parse_config

    argv = _inventory_argv(f"finetune_method={method}", "finetune_use_ema=true")
    cfg = parse_config(argv)  # a flag of another method would be a ConfigError
    assert cfg.method == method and argv[0] == f"--method={method}"
    for name, value in own.items():
        assert getattr(cfg, name) == value, (name, argv)
    assert not set(foreign) & given_flags(argv), argv
    assert cfg.captions == "auto" and "resolution" not in given_flags(argv)  # auto: the family's, the trainer's
    assert not {"snr_gamma", "noise_offset", "timestep_range"} & given_flags(argv), argv  # empty: off
    assert not {"buckets", "min_bucket_reso", "max_bucket_reso", "bucket_reso_steps"} & given_flags(argv), argv


def test_the_bucket_options_reach_the_trainer_when_set() -> None:
    from xeonsd.trainer.argv import parse_config

    argv = _inventory_argv(
        "finetune_buckets=true",
        "finetune_min_bucket_reso=320",
        "finetune_max_bucket_reso=768",
        "finetune_bucket_reso_steps=32",
    )
    cfg = parse_config(argv)
    assert (cfg.buckets, cfg.min_bucket_reso, cfg.max_bucket_reso, cfg.bucket_reso_steps) == (True, 320, 768, 32)
    assert "--buckets" in argv and "--bucket_reso_steps=32" in argv


def test_a_resolution_number_reaches_the_trainer_and_auto_leaves_it_to_the_family() -> None:
    from xeonsd.trainer.argv import given_flags, parse_config

    assert "resolution" not in given_flags(_inventory_argv("finetune_resolution=auto"))
    assert parse_config(_inventory_argv("finetune_resolution=768")).resolution == 768


def test_the_loss_options_reach_the_trainer_when_set() -> None:
    from xeonsd.trainer.argv import parse_config

    argv = _inventory_argv(
        "finetune_method=lora", "finetune_snr_gamma=5", "finetune_noise_offset=0.05", "finetune_timestep_range=100,900"
    )
    cfg = parse_config(argv)
    assert (cfg.snr_gamma, cfg.noise_offset, cfg.timestep_range) == (5.0, 0.05, "100,900"), argv
    assert "--timestep_range=100,900" in argv


def test_the_caption_options_and_the_lora_file_layout_reach_the_trainer() -> None:
    from xeonsd.trainer.argv import given_flags, parse_config

    caption_flags = {"shuffle_tags", "keep_tokens", "caption_dropout", "caption_prefix"}
    assert not caption_flags & given_flags(_inventory_argv("finetune_method=lora"))  # the defaults: off
    argv = _inventory_argv(
        "finetune_method=lora",
        "finetune_shuffle_tags=true",
        "finetune_keep_tokens=2",
        "finetune_caption_dropout=0.1",
        "finetune_caption_prefix=zwx",
    )
    cfg = parse_config(argv)
    assert (cfg.shuffle_tags, cfg.keep_tokens, cfg.caption_dropout, cfg.caption_prefix) == (True, 2, 0.1, "zwx")
    assert cfg.save_format == "diffusers"
    assert (
        parse_config(_inventory_argv("finetune_method=lora", "finetune_lora_save_format=kohya")).save_format == "kohya"
    )
    # textual inversion: the tags' flags only (dropout and prefix are lora/full flags, left out of its list)
    argv = _inventory_argv("finetune_shuffle_tags=true", "finetune_caption_dropout=0.1", "finetune_caption_prefix=z")
    cfg = parse_config(argv)
    assert cfg.shuffle_tags and not {"caption_dropout", "caption_prefix"} & given_flags(argv), argv


def test_the_validation_loss_options_reach_the_trainer_when_set() -> None:
    from xeonsd.trainer.argv import given_flags, parse_config

    names = {"validation_split", "validation_data_dir", "validation_steps"}
    assert not names & given_flags(_inventory_argv())  # empty: off
    cfg = parse_config(_inventory_argv("finetune_validation_split=0.1", "finetune_validation_steps=25"))
    assert (cfg.validation_split, cfg.validation_steps, cfg.validation_data_dir) == (0.1, 25, None)
    cfg = parse_config(_inventory_argv("finetune_validation_data_dir=/srv/held-out"))
    assert (cfg.validation_split, cfg.validation_data_dir) == (0.0, "/srv/held-out")


def test_a_method_the_trainer_does_not_know_is_refused() -> None:
    with pytest.raises(TrainArgvError, match="finetune_method 'dreambooth': choose one of textual_inversion, lora"):
        train_argv({"all": {"seed": 7}}, "dreambooth")
    assert train_argv({"all": {"seed": 7, "scale_lr": False, "x": ""}, "lora": {"rank": 8}}, "lora", ["--y"]) == [
        "--method=lora",
        "--seed=7",
        "--rank=8",
        "--y",
    ]


# ---- the methods and their result files: the package's method_names, read by the plugin ---------------------------


def test_the_plugin_s_methods_and_results_are_the_package_s() -> None:
    from xeonsd.contracts import method_names
    from xeonsd.trainer.methods import method_class

    assert xeonsd_train.METHODS == method_names.METHODS
    for name in method_names.METHODS:
        info = xeonsd_train.method(name)
        assert info["result"] == method_class(name).outputs[0] == method_names.result_file(name)
    with pytest.raises(TrainArgvError, match="finetune_method 'dreambooth': choose one of textual_inversion, lora"):
        xeonsd_train.method("dreambooth")


def test_a_run_s_result_reaches_its_images_by_its_method_and_family() -> None:
    """The base model's shared export with --embeds or --lora at generation time; a full fine-tune's own export; and
    a LoRA fused into an export of its own where GenAI applies no adapters to the family (SD3, Z-Image)."""
    lora = {"method": "lora", "base_model": "/m/b", "result": {"path": "pytorch_lora_weights.safetensors"}}
    route = xeonsd_train.result_export({**lora, "family": "flux2"}, "/runs/r1", 0.8)
    assert route == {
        "own": False,
        "source": "/m/b",
        "args": [],
        "generate_args": ["--lora", "/runs/r1/pytorch_lora_weights.safetensors:0.8"],
        "why": "",
    }
    assert xeonsd_train.result_export(lora, "/runs/r1")["generate_args"][1].endswith(":1.0")  # no family: an SD run
    ti = {"method": "textual_inversion", "base_model": "/m/b", "result": {"path": "learned_embeds.safetensors"}}
    assert xeonsd_train.result_export(ti, "/r")["generate_args"] == ["--embeds", "/r/learned_embeds.safetensors"]
    full = xeonsd_train.result_export({"method": "full", "base_model": "/m/b", "result": {"path": "x"}}, "/r")
    assert (full["own"], full["source"], full["args"], full["generate_args"]) == (True, "/r", [], [])
    for family, label in (("zimage", "Z-Image"), ("sd3", "SD3/SD3.5")):
        fused = xeonsd_train.result_export({**lora, "family": family}, "/r", "0.5")
        assert (fused["own"], fused["source"], fused["generate_args"]) == (True, "/m/b", [])
        assert fused["args"] == ["--lora", "/r/pytorch_lora_weights.safetensors", "--lora-scale", "0.5"]
        assert label in fused["why"]
    with pytest.raises(TrainArgvError, match="/r/train_summary.json: .*wan"):
        xeonsd_train.result_export({**lora, "family": "wan"}, "/r")


def test_no_role_or_plugin_names_a_result_file_again() -> None:
    """The result files are method_names' alone: the roles read them from the xeonsd_method filter or from
    train_summary.json. (A whole pipeline's model_index.json is every diffusers pipeline's, not only a result.)"""
    from xeonsd.contracts.method_names import METHOD_FILES

    names = [m["result"] for m in METHOD_FILES.values() if not m["pipeline"]]
    for path in [
        *REPO.glob("roles/**/*.yml"),
        *REPO.glob("roles/**/*.j2"),
        *REPO.glob("plugins/**/*.py"),
        *REPO.glob("playbooks/*.yml"),
        *REPO.glob("*.yml"),
    ]:
        code = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
        assert not [n for n in names if any(n in ln for ln in code)], f"{path} names a result file"


def test_ansible_renders_the_method_filters() -> None:
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    msg = (
        "{{ ['lora' | xeonsd_method, {'method': 'textual_inversion', 'base_model': '/m/b',"
        " 'result': {'path': 'e.safetensors'}} | xeonsd_result_export('/r')] }}"
    )
    proc = subprocess.run(
        [
            str(VENV_BIN / "ansible"),
            "localhost",
            "-i",
            "inventory",
            "-m",
            "ansible.builtin.debug",
            "-a",
            json.dumps({"msg": msg}),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info, args = json.loads(proc.stdout.split("=>", 1)[1])["msg"]
    assert info == {
        "name": "lora",
        "result": "pytorch_lora_weights.safetensors",
        "what": "LoRA adapter",
        "pipeline": False,
        "generate_flag": "--lora",
        "needs": ["peft"],
    }
    assert (args["own"], args["generate_args"]) == (False, ["--embeds", "/r/e.safetensors"])


def test_prior_preservation_reaches_the_trainer_only_when_on() -> None:
    from xeonsd.trainer.argv import given_flags, parse_config

    prior_flags = {"with_prior_preservation", "class_prompt", "class_data_dir", "num_class_images", "prior_loss_weight"}
    prior_flags.add("class_export")
    assert not prior_flags & given_flags(_inventory_argv("finetune_method=full"))  # the default: off
    argv = _inventory_argv(
        "finetune_method=lora",
        "finetune_with_prior_preservation=true",
        '{"finetune_class_prompt": "a photo of a toy"}',  # key=value would split at the spaces
        "finetune_class_data_dir=/srv/class",
        "finetune_num_class_images=20",
        "finetune_prior_loss_weight=0.5",
    )
    cfg = parse_config(argv)
    assert cfg.with_prior_preservation and cfg.class_prompt == "a photo of a toy", argv
    assert (cfg.class_data_dir, cfg.num_class_images, cfg.prior_loss_weight) == ("/srv/class", 20, 0.5), argv
    assert cfg.class_export.endswith("/openvino-base"), argv  # export.yml's cache of the base models' exports


# ---- one definition each: a flag in one group of the inventory's file, the method in one place -------------------


def _own_keys(node: yaml.MappingNode) -> list[str]:
    """The keys written in this mapping itself (not those it merges in with ``<<: *anchor``)."""
    return [k.value for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge" and k.value != "<<"]


def test_no_training_flag_is_written_twice_and_finetune_method_once() -> None:
    """finetune_train_flags names each flag once in the file: lora and full share theirs through one anchored
    mapping (merged into both), not by restating them; and finetune_method is the inventory's, not also a role
    default that could disagree with it."""
    path = REPO / "inventory" / "group_vars" / "all" / "finetune.yml"
    top = yaml.compose(path.read_text())
    (flags,) = [v for k, v in top.value if k.value == "finetune_train_flags"]
    written: list[str] = []
    merged: dict[int, yaml.MappingNode] = {}
    for _, group in flags.value:
        written += _own_keys(group)
        for key, value in group.value:
            if key.value == "<<":
                for shared in value.value if isinstance(value, yaml.SequenceNode) else [value]:
                    merged[id(shared)] = shared
    for shared in merged.values():  # an anchored mapping counts once, however many groups merge it
        written += _own_keys(shared)
    twice = sorted({k for k in written if written.count(k) > 1})
    assert not twice, f"{path}: written in more than one group of finetune_train_flags: {twice}"
    assert merged, "lora and full no longer share their flags through an anchor: this test checks nothing"

    definitions = [
        p.relative_to(REPO)
        for p in [*REPO.glob("inventory/group_vars/all/*.yml"), *REPO.glob("roles/*/defaults/main.yml")]
        if "finetune_method" in (yaml.safe_load(p.read_text()) or {})
    ]
    assert [str(p) for p in definitions] == ["inventory/group_vars/all/finetune.yml"], definitions
