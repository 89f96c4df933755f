"""What serve.yml serves (xeonsd.contracts.serve_plan): the run it deploys (LoRA, full, textual inversion), the
adapters it registers by name, the runs it refuses with the variable to fix, and the xeonsd serve command line that
carries them."""

from __future__ import annotations

import pytest

from xeonsd.contracts.serve_plan import ServePlanError, adapter_runs, plan, run_dir, serve_argv

LORA = {
    "method": "lora",
    "base_model": "base",
    "base_model_fingerprint": "fp1",
    "result": {"path": "pytorch_lora_weights.safetensors"},
}
TI = {
    "method": "textual_inversion",
    "base_model": "base",
    "base_model_fingerprint": "fp1",
    "result": {"path": "learned_embeds.safetensors"},
    "placeholder_tokens": ["<dicoo>"],
}
FULL = {"method": "full", "base_model": "base", "base_model_fingerprint": "fp1", "result": {"path": "model_index.json"}}


def test_serve_run_is_latest_a_name_under_runs_dir_or_an_absolute_path() -> None:
    assert run_dir("latest", "/home/d/runs") == "/home/d/runs/latest"
    assert run_dir("20261203-0812", "/home/d/runs") == "/home/d/runs/20261203-0812"
    assert run_dir("/data/runs/x/", "/home/d/runs") == "/data/runs/x"
    for bad in ("", "../etc", "a/b", ".."):
        with pytest.raises(ServePlanError, match="serve_run is .*Fix: set serve_run"):
            run_dir(bad, "/home/d/runs")


def test_adapters_are_runs_or_run_and_alpha_and_bad_entries_name_the_adapter() -> None:
    assert adapter_runs({"a": "r1", "b": {"run": "r2", "alpha": 0.5}}, 1.0) == [
        {"name": "a", "run": "r1", "alpha": 1.0},
        {"name": "b", "run": "r2", "alpha": 0.5},
    ]
    assert adapter_runs({}) == [] and adapter_runs(None) == []
    for bad, match in (
        (["r1"], "maps adapter names to runs"),
        ({"a=b": "r1"}, "'a=b' is not an adapter name"),
        ({"a": {"run": "r1", "weight": 1}}, "unknown key.*weight.*serve_adapters.a"),
        ({"a": {"alpha": 1}}, r"\(no run\)"),
        ({"a": ""}, "a names no run"),
        ({"a": {"run": "r1", "alpha": 0}}, "a's alpha is 0"),
        ({"a": {"run": "r1", "alpha": "x"}}, "a's alpha is 'x'"),
    ):
        with pytest.raises(ServePlanError, match=match):
            adapter_runs(bad)


def test_a_lora_run_serves_the_base_export_with_its_adapter_and_the_named_adapters() -> None:
    served = {"dir": "/r/lora", "summary": LORA}
    extra = [{"name": "style-b", "dir": "/r/lora2", "summary": LORA, "alpha": 0.5}]
    p = plan(served, "/h/openvino-base/fp1-5x1-128x128-fp32", extra, alpha=0.8)
    assert p["export"] == "/h/openvino-base/fp1-5x1-128x128-fp32" and p["method"] == "lora" and p["name"] == "base"
    assert p["adapters"] == [
        {"name": "lora", "run": "/r/lora", "path": "/r/lora/pytorch_lora_weights.safetensors", "alpha": 0.8},
        {"name": "style-b", "run": "/r/lora2", "path": "/r/lora2/pytorch_lora_weights.safetensors", "alpha": 0.5},
    ]
    assert p["files"] == ["/r/lora/pytorch_lora_weights.safetensors", "/r/lora2/pytorch_lora_weights.safetensors"]
    argv = serve_argv(p, {"host": "10.0.0.1", "port": 8000, "workers": "auto", "queue": "", "max_images": 4})
    # a table: each flag beside its value (ruff would put one item per line)
    assert argv == [
        "serve", "/h/openvino-base/fp1-5x1-128x128-fp32",
        "--adapter", "lora=/r/lora/pytorch_lora_weights.safetensors:0.8",
        "--adapter", "style-b=/r/lora2/pytorch_lora_weights.safetensors:0.5",
        "--name", "base", "--host", "10.0.0.1", "--port", "8000", "--workers", "auto", "--max-images", "4",
    ]  # fmt: skip
    assert serve_argv(p, {"name": "sd15", "port": 8001})[-4:] == ["--name", "sd15", "--port", "8001"]
    assert serve_argv(p, {"precision": "f32"})[-2:] == ["--precision", "f32"]
    assert "--precision" not in serve_argv(p, {"precision": ""})  # empty: xeonsd's default
    with pytest.raises(ServePlanError, match="unknown xeonsd serve setting"):
        serve_argv(p, {"threads": 4})


def test_a_full_fine_tune_serves_its_own_export_without_adapters() -> None:
    p = plan({"dir": "/r/full", "summary": FULL}, "/r/full/openvino")
    assert (p["export"], p["name"], p["adapters"], p["files"]) == ("/r/full/openvino", "full", [], [])
    with pytest.raises(ServePlanError, match="full fine-tune.*serve_adapters=\\{\\}"):
        plan({"dir": "/r/full", "summary": FULL}, "/r/full/openvino", [{"name": "a", "dir": "/r/l", "summary": LORA}])


def test_a_fused_lora_run_serves_its_own_export_alone_and_refuses_other_adapters() -> None:
    """Where GenAI applies no adapters to the family (Z-Image, SD3), export.yml fuses the run's LoRA into the run's
    own export: serve.yml serves that export under the run's name, registers no adapter, and refuses others."""
    p = plan({"dir": "/r/zl", "summary": LORA}, "/r/zl/openvino", fused_family="Z-Image")
    assert (p["export"], p["name"], p["adapters"], p["files"]) == ("/r/zl/openvino", "zl", [], [])
    assert "--adapter" not in serve_argv(p, {})
    other = [{"name": "a", "dir": "/r/l", "summary": LORA}]
    with pytest.raises(ServePlanError, match="Z-Image LoRA run: GenAI applies no adapters to Z-Image.*serve_adapters"):
        plan({"dir": "/r/zl", "summary": LORA}, "/r/zl/openvino", other, fused_family="Z-Image")


def test_a_textual_inversion_run_serves_the_base_export_with_its_concept_under_the_run_s_name() -> None:
    """The base model's export (the run's openvino link) with the run's embeddings and token on the command line,
    the embeddings among the files every node needs, the run's name for the base holding the concept, and LoRA runs
    of the same base registered beside it."""
    served = {"dir": "/r/ti/", "summary": TI}
    p = plan(served, "/h/openvino-base/fp1-5x1-64x64-fp32")
    assert (p["export"], p["name"], p["method"]) == ("/h/openvino-base/fp1-5x1-64x64-fp32", "ti", "textual_inversion")
    assert (p["embeds"], p["token"], p["adapters"]) == ("/r/ti/learned_embeds.safetensors", "<dicoo>", [])
    assert p["files"] == ["/r/ti/learned_embeds.safetensors"]
    assert serve_argv(p, {"port": 8000}) == [
        "serve", "/h/openvino-base/fp1-5x1-64x64-fp32",
        "--embeds", "/r/ti/learned_embeds.safetensors", "--token", "<dicoo>",
        "--name", "ti", "--port", "8000",
    ]  # fmt: skip
    # a summary without placeholder_tokens (the file names its token): no --token
    unnamed = plan({"dir": "/r/ti", "summary": {k: v for k, v in TI.items() if k != "placeholder_tokens"}}, "/h/b")
    assert unnamed["token"] is None and "--token" not in serve_argv(unnamed, {})
    style = [{"name": "style", "dir": "/r/lora", "summary": LORA, "alpha": 0.5}]
    p = plan(served, "/h/b", style, blends=["@style:0.7"])
    assert (p["name"], [a["name"] for a in p["adapters"]], p["blends"]) == ("ti", ["style"], ["@style:0.7"])
    assert p["files"] == ["/r/lora/pytorch_lora_weights.safetensors", "/r/ti/learned_embeds.safetensors"]
    assert serve_argv(p, {})[2:6] == ["--embeds", "/r/ti/learned_embeds.safetensors", "--token", "<dicoo>"]
    with pytest.raises(ServePlanError, match="ti is registered twice \\(serve_run's concept takes its run's name"):
        plan(served, "/h/b", [{"name": "ti", "dir": "/r/lora", "summary": LORA}])
    with pytest.raises(ServePlanError, match="has no OpenVINO export .*export.yml -e openvino_export_run_dir=/r/ti"):
        plan({"dir": "/r/ti", "summary": TI}, "")
    other_base = {**LORA, "base_model_fingerprint": "fp2"}
    with pytest.raises(ServePlanError, match="s \\(/r/o\\) was trained on another base model"):
        plan(served, "/h/b", [{"name": "s", "dir": "/r/o", "summary": other_base}])


def test_runs_that_cannot_be_served_are_refused_naming_the_fix() -> None:
    with pytest.raises(ServePlanError, match="has no OpenVINO export .*export.yml -e openvino_export_run_dir=/r/l"):
        plan({"dir": "/r/l", "summary": LORA}, "")
    other_base = {**LORA, "base_model": "other", "base_model_fingerprint": "fp2"}
    with pytest.raises(ServePlanError, match="b \\(/r/o\\) was trained on another base model"):
        plan({"dir": "/r/l", "summary": LORA}, "/h/base", [{"name": "b", "dir": "/r/o", "summary": other_base}])
    with pytest.raises(ServePlanError, match="b names /r/f, a full run, not LoRA"):
        plan({"dir": "/r/l", "summary": LORA}, "/h/base", [{"name": "b", "dir": "/r/f", "summary": FULL}])
    with pytest.raises(ServePlanError, match="l is registered twice"):
        plan({"dir": "/r/l", "summary": LORA}, "/h/base", [{"name": "l", "dir": "/r/m", "summary": LORA}])
    with pytest.raises(ServePlanError, match="names no known method"):
        plan({"dir": "/r/x", "summary": {}}, "/h/base")
    with pytest.raises(ServePlanError, match="names no known method \\('dreambooth'\\)"):
        plan({"dir": "/r/x", "summary": {**TI, "method": "dreambooth"}}, "/h/base")


def test_a_family_without_an_openvino_export_is_served_on_torch_from_its_pipeline() -> None:
    """FLUX.1 Kontext, Qwen-Image-Edit, Krea 2 (no optimum-intel export): a LoRA run serves the base model's pipeline
    directory with its adapter, a full fine-tune its own pipeline, on xeonsd serve --engine torch; a base model that
    is not a directory is refused naming the fix. The export link is not read."""
    lora = {**LORA, "base_model": "/models/qwen-edit/"}
    p = plan({"dir": "/r/ql", "summary": lora}, "", torch_family="Qwen-Image-Edit-2511")
    assert (p["export"], p["engine"], [a["name"] for a in p["adapters"]]) == ("/models/qwen-edit", "torch", ["ql"])
    assert serve_argv(p, {})[:4] == ["serve", "/models/qwen-edit", "--engine", "torch"]
    full = plan({"dir": "/r/qf", "summary": FULL}, "", torch_family="FLUX.1 Kontext")
    assert (full["export"], full["engine"], full["adapters"]) == ("/r/qf", "torch", [])
    assert plan({"dir": "/r/l", "summary": LORA}, "/h/base")["engine"] == "genai"
    assert "--engine" not in serve_argv(plan({"dir": "/r/l", "summary": LORA}, "/h/base"), {})
    with pytest.raises(ServePlanError, match="its base_model 'base' is no absolute path. Fix: train from a local"):
        plan({"dir": "/r/ql", "summary": LORA}, "", torch_family="Qwen-Image-Edit-2511")


@pytest.mark.parametrize("kind", ["dora", "lokr", "loha"])
def test_another_adapter_type_than_lora_is_served_alone_as_its_fused_export(kind) -> None:
    """GenAI applies plain LoRA only: a DoRA, LoKr or LoHa run is served from its own export (export.yml fused it
    in) under the run's name, registers no adapter and refuses serve_adapters; as a serve_adapters entry it is
    refused. On the PyTorch engine a DoRA is registered as LoRA is; a LoKr or LoHa cannot be switched per request."""
    other = {**LORA, "adapter": kind}
    with pytest.raises(ServePlanError, match=f"b \\(/r/k\\) is a {kind} run: GenAI applies plain LoRA per request"):
        plan({"dir": "/r/l", "summary": LORA}, "/h/base", [{"name": "b", "dir": "/r/k", "summary": other}])
    p = plan({"dir": "/r/k", "summary": other}, "/r/k/openvino")
    assert (p["export"], p["name"], p["adapters"], p["files"], p["engine"]) == ("/r/k/openvino", "k", [], [], "genai")
    assert "--adapter" not in serve_argv(p, {})
    with pytest.raises(ServePlanError, match=f"/r/k is a {kind} run: GenAI applies plain LoRA only, so its export"):
        plan({"dir": "/r/k", "summary": other}, "/r/k/openvino", [{"name": "a", "dir": "/r/l", "summary": LORA}])
    torch_run = {"dir": "/r/k", "summary": {**other, "base_model": "/m/q"}}
    if kind == "dora":
        p = plan(torch_run, "", torch_family="FLUX.1 Kontext")
        assert p["engine"] == "torch" and [a["name"] for a in p["adapters"]] == ["k"]
    else:
        with pytest.raises(ServePlanError, match=f"{kind} run of FLUX.1 Kontext, which the PyTorch engine serves"):
            plan(torch_run, "", torch_family="FLUX.1 Kontext")
