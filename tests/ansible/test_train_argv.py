"""The inventory's `xeonsd train` argument list: each trainer flag from its finetune_<flag> variable, the chosen
method's flags and no other method's (the trainer refuses those), rendered by Ansible from
inventory/group_vars/all/finetune.yml and parsed by xeonsd train's own parser."""

from __future__ import annotations

import dataclasses
import json
import os
import re
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
            {"placeholder_token": "<dicoo>", "initializer_token": "toy", "straggler_cpu_util": 0.8},
            ("rank", "instance_prompt"),
        ),
        (
            "lora",
            {
                "rank": 4,
                "instance_prompt": "a photo of a <dicoo> toy",
                "learning_rate": 1e-4,
                "save_format": "diffusers",
            },
            ("placeholder_token", "use_ema", "save_as_full_pipeline"),
        ),
        (
            "full",
            {"use_ema": True, "instance_prompt": "a photo of a <dicoo> toy", "learning_rate": 1e-5},
            ("placeholder_token", "rank", "lora_target_modules"),
        ),
    ],
)
def test_the_inventorys_argv_is_what_xeonsd_train_parses_with_only_the_chosen_methods_flags(
    method, own, foreign
) -> None:
    from xeonsd.trainer.argv import given_flags, parse_config

    argv = _inventory_argv(f"finetune_method={method}", "finetune_use_ema=true")
    cfg = parse_config(argv)  # xeonsd train's own parser: a flag of another method would be a ConfigError
    assert cfg.method == method and argv[0] == f"--method={method}"
    for name, value in own.items():
        assert getattr(cfg, name) == value, (name, argv)
    assert cfg.pretrained_model_name_or_path == "/home/devcloud/models/stable-diffusion-v1-5", argv
    assert not set(foreign) & given_flags(argv), argv
    assert cfg.captions == "auto" and cfg.resolution is None  # auto: the family's (the trainer takes "auto")
    assert not {"snr_gamma", "noise_offset", "timestep_range", "buckets", "min_bucket_reso"} & given_flags(argv)
    assert not {"keep_tokens", "class_prompt", "class_export", "num_class_images"} & given_flags(argv), argv


def test_a_flag_the_trainer_gains_reaches_the_argv_from_its_finetune_variable(monkeypatch) -> None:
    """The filter reads the trainer's flag table: a new field of TrainConfig is a finetune_<flag> variable at once,
    of its method only, a boolean as the bare flag."""
    from xeonsd.trainer.config import LORA, TrainConfig, _flag

    @dataclasses.dataclass
    class Gained(TrainConfig):
        new_knob: int = _flag("a flag added tomorrow", default=3)
        new_switch: bool = _flag("a LoRA-only switch", methods=(LORA,), default=False)

    monkeypatch.setattr(xeonsd_train.train_config, "TrainConfig", Gained)
    assert {"finetune_new_knob", "finetune_new_switch"} <= set(xeonsd_train.train_vars("lora"))
    assert "finetune_new_switch" not in xeonsd_train.train_vars("full")
    values = {"finetune_new_knob": 7, "finetune_new_switch": "true", "finetune_seed": 1}
    assert train_argv(values, "lora") == ["--method=lora", "--seed=1", "--new_knob=7", "--new_switch"]
    assert train_argv(values, "full") == ["--method=full", "--seed=1", "--new_knob=7"]


def test_any_trainer_flag_reaches_the_argv_with_e_and_the_renamed_variables_are_the_flags_names() -> None:
    from xeonsd.trainer.argv import parse_config

    argv = _inventory_argv(
        "finetune_method=lora",
        '{"finetune_validation_prompt": "a <dicoo> toy"}',  # not in the inventory: the trainer's flag all the same
        "finetune_max_train_steps=400",
        "finetune_rank=8",
        "finetune_train_text_encoder=true",
        "finetune_save_format=kohya",
        "finetune_straggler_cpu_util=0",
        "finetune_pretrained_model_name_or_path=/m/other",
        "finetune_fused_adamw=false",  # a flag that defaults to on: --no-fused_adamw
        "finetune_resolution=768",
    )
    cfg = parse_config(argv)
    assert (cfg.validation_prompt, cfg.max_train_steps, cfg.rank, cfg.save_format) == ("a <dicoo> toy", 400, 8, "kohya")
    assert (cfg.train_text_encoder, cfg.straggler_cpu_util, cfg.fused_adamw) == (True, 0.0, False), argv
    assert (cfg.pretrained_model_name_or_path, cfg.resolution) == ("/m/other", 768), argv
    assert "--no-fused_adamw" in argv and "--train_text_encoder" in argv


def test_every_finetune_variable_of_the_inventory_is_a_trainer_flag_or_a_playbook_setting() -> None:
    """The rule is simply finetune_<flag>: a variable that names no flag would be silently left out of the list."""
    import dataclasses as dc

    from xeonsd.trainer.config import TrainConfig

    flags = {f"finetune_{f.name}" for f in dc.fields(TrainConfig)}
    settings = {"finetune_extra_args", "finetune_train_vars", "finetune_train_argv"}  # not flags: the play's own
    names = set(yaml.safe_load((REPO / "inventory/group_vars/all/finetune.yml").read_text()))
    assert names - flags - settings == set()
    # the names before the rule, e.g. finetune_lora_rank (now finetune_rank), and the map they fed
    renamed = ["lora_rank", "cpu_util_warn", "lora_train_text_encoder", "lora_save_format", "class_export_dir"]
    renamed += ["pretrained_model", "train_flags", "lora_full_flags"]
    files = [*REPO.glob("roles/**/*.yml"), *REPO.glob("*.yml"), *REPO.glob("playbooks/*.yml")]
    files += [*REPO.glob("inventory/**/*.yml"), *REPO.glob("tests/cluster/**/*.py"), *REPO.glob("docs/*.md")]
    files += [*REPO.glob("tests/cluster/group_vars/*.yml"), REPO / "README.md", *REPO.glob("roles/*/README.md")]
    old = re.compile(r"\bfinetune_(?:" + "|".join(renamed) + r")\b")
    stale = [f"{p.relative_to(REPO)}: {m.group()}" for p in files for m in old.finditer(p.read_text())]
    assert not stale, stale


def test_the_bucket_loss_caption_and_validation_options_reach_the_trainer_when_set() -> None:
    from xeonsd.trainer.argv import given_flags, parse_config

    argv = _inventory_argv(
        "finetune_method=lora",
        "finetune_buckets=true",
        "finetune_min_bucket_reso=320",
        "finetune_bucket_reso_steps=32",
        "finetune_snr_gamma=5",
        "finetune_timestep_range=100,900",
        "finetune_shuffle_tags=true",
        "finetune_keep_tokens=2",
        "finetune_caption_dropout=0.1",
        "finetune_caption_prefix=zwx",
        "finetune_validation_split=0.1",
        "finetune_validation_steps=25",
    )
    cfg = parse_config(argv)
    assert (cfg.buckets, cfg.min_bucket_reso, cfg.max_bucket_reso, cfg.bucket_reso_steps) == (True, 320, None, 32)
    assert (cfg.snr_gamma, cfg.noise_offset, cfg.timestep_range) == (5.0, 0.0, "100,900"), argv
    assert (cfg.shuffle_tags, cfg.keep_tokens, cfg.caption_dropout, cfg.caption_prefix) == (True, 2, 0.1, "zwx")
    assert (cfg.validation_split, cfg.validation_steps, cfg.validation_data_dir) == (0.1, 25, None)
    assert "--buckets" in argv and "--timestep_range=100,900" in argv
    # textual inversion: the tags' flags only (dropout and prefix are lora/full flags, left out of its list)
    argv = _inventory_argv("finetune_shuffle_tags=true", "finetune_caption_dropout=0.1", "finetune_caption_prefix=z")
    assert parse_config(argv).shuffle_tags and not {"caption_dropout", "caption_prefix"} & given_flags(argv), argv


def test_a_method_the_trainer_does_not_know_is_refused_and_empty_values_are_left_out() -> None:
    with pytest.raises(TrainArgvError, match="finetune_method 'dreambooth': choose one of textual_inversion, lora"):
        train_argv({"finetune_seed": 7}, "dreambooth")
    with pytest.raises(TrainArgvError, match="finetune_method 'dreambooth'"):
        xeonsd_train.train_vars("dreambooth")
    values = [("finetune_seed", 7), ("finetune_scale_lr", False), ("finetune_rank", 8), ("finetune_lora_alpha", "")]
    values += [("finetune_keep_tokens", 2), ("finetune_placeholder_token", "<x>"), ("finetune_class_prompt", "a")]
    assert train_argv(values, "lora", ["--y"]) == ["--method=lora", "--rank=8", "--seed=7", "--y"]
    values += [("finetune_shuffle_tags", True), ("finetune_with_prior_preservation", "yes")]
    argv = train_argv(values, "lora")
    assert {"--shuffle_tags", "--keep_tokens=2", "--with_prior_preservation", "--class_prompt=a"} <= set(argv)


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
    # finetune_save_format comfyui: ComfyUI's file is fetched beside the result, of any adapter type
    comfy = method_names.COMFYUI_FILE
    assert xeonsd_train.method("lora", "lora", "comfyui")["files"] == [method_names.result_file("lora"), comfy]
    assert xeonsd_train.method("lora", "lokr", "comfyui")["files"] == [*method_names.PEFT_FILES, comfy]
    assert xeonsd_train.method("lora", "lora", "kohya")["files"] == [method_names.result_file("lora")]


def test_a_lokr_or_loha_run_fetches_peft_s_files_and_every_other_type_is_fused_into_its_own_export() -> None:
    """GenAI applies plain LoRA only: a DoRA, LoKr or LoHa run of a family with an OpenVINO export gets an export of
    its own with the adapter fused in (--lora FILE --lora-scale S; a LoKr/LoHa's FILE is peft's weights, beside the
    config); one without goes to the torch engine with --lora (which loads DoRA and merges LoKr/LoHa)."""
    from xeonsd.trainer.methods.adapters import PEFT_FILES

    assert xeonsd_train.method("lora", "dora")["files"] == ["pytorch_lora_weights.safetensors"]
    for kind in ("lokr", "loha"):
        info = xeonsd_train.method("lora", kind)
        assert (info["result"], info["files"], info["generate_flag"]) == (PEFT_FILES[0], list(PEFT_FILES), None)
    with pytest.raises(TrainArgvError, match="finetune_adapter 'oft': choose one of lora, lokr, loha, dora"):
        xeonsd_train.method("lora", "oft")
    for kind, result in (
        ("dora", "pytorch_lora_weights.safetensors"),
        ("lokr", PEFT_FILES[0]),
        ("loha", PEFT_FILES[0]),
    ):
        run = {"method": "lora", "adapter": kind, "base_model": "/m/b", "result": {"path": result}}
        for family in ("sd", "sdxl", "flux", "sd3"):
            route = xeonsd_train.result_export({**run, "family": family}, "/r", "0.7")
            assert (route["export"], route["own"], route["source"], route["generate_args"]) == (True, True, "/m/b", [])
            assert route["args"] == ["--lora", f"/r/{result}", "--lora-scale", "0.7"]
            assert f"the {kind} adapter fused into the base model" in route["why"]
        shape = ["--batch-size", "1"]
        route = xeonsd_train.result_export({**run, "family": "flux_kontext"}, "/r", 0.5, shape)
        assert (route["export"], route["own"], route["args"]) == (False, False, [])
        assert route["generate_args"] == ["--engine", "torch", *shape, "--lora", f"/r/{result}:0.5"]


def test_a_run_s_result_reaches_its_images_by_its_method_and_family() -> None:
    """The base model's shared export with --embeds or --lora at generation time; a full fine-tune's own export; and
    a LoRA fused into an export of its own where GenAI applies no adapters to the family (SD3, Z-Image)."""
    lora = {"method": "lora", "base_model": "/m/b", "result": {"path": "pytorch_lora_weights.safetensors"}}
    route = xeonsd_train.result_export({**lora, "family": "flux2"}, "/runs/r1", 0.8)
    assert route == {
        "export": True,
        "own": False,
        "source": "/m/b",
        "args": [],
        "generate_args": ["--lora", "/runs/r1/pytorch_lora_weights.safetensors:0.8"],
        "why": "",
        "before": {"source": None, "generate_args": [], "engine": "openvino"},
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


def test_a_run_of_a_family_without_an_openvino_export_goes_to_the_torch_engine() -> None:
    """FLUX.1 Kontext and Qwen-Image-Edit (no optimum-intel export): no export; `xeonsd generate` runs the base model
    (a full fine-tune: the run's own pipeline) on the torch engine with the shape the export would have had, the
    LoRA, and the run's sample references as --image."""
    shape = ["--batch-size", "5", "--height", "512", "--width", "512"]
    lora = {"method": "lora", "base_model": "/m/b", "result": {"path": "pytorch_lora_weights.safetensors"}}
    refs = {"sample_references": ["/data/ref/p0.png", "/data/ref/p0b.png"]}
    route = xeonsd_train.result_export({**lora, "family": "qwenimage_edit", **refs}, "/r", 0.8, shape)
    assert route["export"] is False and (route["own"], route["source"], route["args"]) == (False, "/m/b", [])
    assert route["generate_args"] == [
        "--engine", "torch", *shape, "--lora", "/r/pytorch_lora_weights.safetensors:0.8",
        "--image", "/data/ref/p0.png", "--image", "/data/ref/p0b.png",
    ]  # fmt: skip
    assert "Qwen-Image-Edit-2511" in route["why"]
    full = {"method": "full", "base_model": "/m/b", "result": {"path": "x"}, "family": "flux_kontext"}
    route = xeonsd_train.result_export(full, "/r", 1.0, shape)
    assert (route["export"], route["source"], route["generate_args"]) == (False, "/r", ["--engine", "torch", *shape])
    assert xeonsd_train.result_export({**lora, "family": "flux"}, "/r")["export"] is True  # FLUX.1 has one
    turbo = {**lora, "family": "krea2", "inference_model": "/m/turbo"}  # a LoRA trained on RAW, rendered on Turbo
    assert xeonsd_train.result_export(turbo, "/r", 1.0, shape)["source"] == "/m/turbo"

    from xeonsd.cli import build_parser  # the arguments are xeonsd generate's

    args = build_parser().parse_args(
        ["generate", "/m/b", *xeonsd_train.result_export(full, "/r", 1, shape)["generate_args"]]
    )
    assert (args.engine, args.batch_size, args.height, args.width) == ("torch", 5, 512, 512)


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
        "{{ ['lora' | xeonsd.cluster.xeonsd_method, {'method': 'textual_inversion', 'base_model': '/m/b',"
        " 'result': {'path': 'e.safetensors'}} | xeonsd.cluster.xeonsd_result_export('/r')] }}"
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
        "files": ["pytorch_lora_weights.safetensors"],
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


# ---- one definition each: the method in one place ------------------------------------------------------------


def test_finetune_method_is_defined_once() -> None:
    """finetune_method is the inventory's, not also a role default that could disagree with it."""
    definitions = [
        p.relative_to(REPO)
        for p in [*REPO.glob("inventory/group_vars/all/*.yml"), *REPO.glob("roles/*/defaults/main.yml")]
        if "finetune_method" in (yaml.safe_load(p.read_text()) or {})
    ]
    assert [str(p) for p in definitions] == ["inventory/group_vars/all/finetune.yml"], definitions


def test_the_before_row_is_the_base_model_at_the_same_size_without_the_result() -> None:
    """The report's before row: the shared base export the result loads onto, without the result's flag; for a run
    with an export of its own (full, fused), the base model's pipeline in PyTorch at the export's size; for a family
    without an export, the after row's model and references without the adapter."""
    shape = ["--batch-size", "5", "--height", "64", "--width", "64"]
    lora = {"method": "lora", "base_model": "/m/b", "result": {"path": "pytorch_lora_weights.safetensors"}}
    ti = {"method": "textual_inversion", "base_model": "/m/b", "result": {"path": "learned_embeds.safetensors"}}
    for run in (ti, lora):
        assert xeonsd_train.result_export(run, "/r", 1.0, shape)["before"] == {
            "source": None, "generate_args": [], "engine": "openvino"
        }  # fmt: skip
    torch_base = {"source": "/m/b", "generate_args": ["--engine", "torch", *shape], "engine": "torch"}
    full = {"method": "full", "base_model": "/m/b", "result": {"path": "x"}}
    assert xeonsd_train.result_export(full, "/r", 1.0, shape)["before"] == torch_base
    assert xeonsd_train.result_export({**lora, "family": "zimage"}, "/r", 1.0, shape)["before"] == torch_base
    refs = {"sample_references": ["/data/ref/p0.png"], "family": "qwenimage_edit"}
    before = xeonsd_train.result_export({**lora, **refs}, "/r", 0.8, shape)["before"]
    assert before["generate_args"] == ["--engine", "torch", *shape, "--image", "/data/ref/p0.png"]
    turbo = {**lora, "family": "krea2", "inference_model": "/m/turbo"}
    assert xeonsd_train.result_export(turbo, "/r", 1.0, shape)["before"]["source"] == "/m/turbo"
