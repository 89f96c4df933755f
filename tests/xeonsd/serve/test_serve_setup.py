"""What ``xeonsd serve`` checks before it compiles anything (a one-line error, exit 2), and the OVMS configuration
it writes for the same export and adapters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.numpy import save_file

from xeonsd import cli

pytestmark = pytest.mark.xdist_group("xeonsd-serve")  # beside test_serve_api.py: the adapter is made once


def _refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("xeonsd serve: error: "), err
    return err[0]


def test_bad_options_are_refused_before_anything_is_compiled(
    ov_base: Path, toy_adapter: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "does not exist" in _refusal(capsys, str(ov_base), f"--adapter=a={tmp_path / 'none.safetensors'}")
    assert "NAME=PATH" in _refusal(capsys, str(ov_base), f"--adapter={toy_adapter}")
    assert "given twice" in _refusal(capsys, str(ov_base), f"--adapter=a={toy_adapter}", f"--adapter=a={toy_adapter}")
    assert "base model's name" in _refusal(capsys, str(ov_base), "--name=b", f"--adapter=b={toy_adapter}")
    assert "--workers" in _refusal(capsys, str(ov_base), "--workers=0")
    assert "--workers" in _refusal(capsys, str(ov_base), "--workers=many")
    assert "--timeout" in _refusal(capsys, str(ov_base), "--timeout=0")
    assert "not an xeonsd OpenVINO export" in _refusal(capsys, str(tmp_path))
    other = tmp_path / "other.safetensors"  # an adapter of a module the export does not have
    save_file(
        {"lora_unet_nowhere.lora_down.weight": _ones(2, 8), "lora_unet_nowhere.lora_up.weight": _ones(8, 2)}, other
    )
    assert "other.safetensors" in _refusal(capsys, str(ov_base), f"--adapter=o={other}")
    xl = tmp_path / "xl.safetensors"  # an SDXL adapter (it adapts a second text encoder) on the SD export
    te2 = "lora_te2_text_model_encoder_layers_0_self_attn_q_proj"
    save_file({f"{te2}.lora_down.weight": _ones(2, 8), f"{te2}.lora_up.weight": _ones(8, 2)}, xl)
    assert "made for SDXL" in _refusal(capsys, str(ov_base), f"--adapter=x={xl}")


def test_a_concept_that_cannot_be_served_is_refused_before_anything_is_compiled(
    ov_base: Path, embeds: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--embeds: a missing or unreadable file, an SDXL concept on the SD export, vectors of another model's width, a
    token the tokenizer already knows, an adapter of another family beside it, --token alone, and OVMS's config
    (which would load the export without the concept) are each one line and exit 2, with no overlay left behind."""
    import torch
    from safetensors.torch import save_file as save_torch

    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # where xeonsd serve writes its overlay
    (tmp_path / "tmp").mkdir()
    export = str(ov_base)
    missing = tmp_path / "none.safetensors"
    assert f"--embeds: embeddings file {missing} does not exist" in _refusal(capsys, export, f"--embeds={missing}")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    assert "is not a readable safetensors file" in _refusal(capsys, export, f"--embeds={garbage}")
    xl = tmp_path / "xl.safetensors"
    save_torch({"clip_l": torch.zeros(1, 32), "clip_g": torch.zeros(1, 32)}, str(xl))
    assert "is an SDXL embedding" in _refusal(capsys, export, f"--embeds={xl}")
    wide = tmp_path / "wide.safetensors"  # a concept of a model with a wider text encoder (SD 2.x's 1024)
    save_torch({"<wide>": torch.zeros(1, 64)}, str(wide))
    assert "vectors have 64 values but this text encoder's hidden size is 32" in _refusal(
        capsys, export, f"--embeds={wide}"
    )
    assert "token 'toy' collides with an existing token" in _refusal(
        capsys, export, f"--embeds={embeds}", "--token=toy"
    )
    xl_lora = tmp_path / "xl-lora.safetensors"
    te2 = "lora_te2_text_model_encoder_layers_0_self_attn_q_proj"
    save_file({f"{te2}.lora_down.weight": _ones(2, 8), f"{te2}.lora_up.weight": _ones(8, 2)}, xl_lora)
    assert "made for SDXL" in _refusal(capsys, export, f"--embeds={embeds}", f"--adapter=x={xl_lora}")
    assert "--token names the --embeds concept" in _refusal(capsys, export, "--token=<dicoo>")
    refused = _refusal(capsys, export, f"--embeds={embeds}", f"--write-ovms-config={tmp_path / 'ovms'}")
    assert f"xeonsd export SRC OUT --embeds {embeds}" in refused and not (tmp_path / "ovms").exists()
    assert list((tmp_path / "tmp").iterdir()) == []  # each refusal cleaned its working directory


def test_a_concept_on_a_family_without_textual_inversion_is_refused_before_it_is_read(
    ov_base: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """FLUX.1 (no concept_layout: a flow family) is refused by the family's name before the file is even read (it
    does not exist here)."""
    from xeonsd.families import by_name
    from xeonsd.serve import prepare

    read_export = prepare.read_export
    monkeypatch.setattr(prepare, "read_export", lambda o: (*read_export(o)[:2], by_name("flux")))
    line = _refusal(capsys, str(ov_base), "--embeds=/nowhere/learned_embeds.safetensors")
    assert "--embeds: FLUX.1 has no textual-inversion concepts" in line and "serve a LoRA" in line


def test_an_sd_concept_on_an_sdxl_export_is_refused_naming_the_layout(embeds: Path) -> None:
    from xeonsd.families import by_name
    from xeonsd.serve.concept import read_concepts
    from xeonsd.serve.options import ServeError, ServeOptions

    with pytest.raises(ServeError, match="--embeds: .* is an embedding for SD 1.x/2.x .* this model is SDXL"):
        read_concepts(ServeOptions(export_dir=Path("x"), embeds=embeds), by_name("sdxl"))


def _ones(*shape: int):
    import numpy as np

    return np.ones(shape, dtype=np.float32)


def test_ovms_config_serves_the_same_export_and_adapters(ov_base: Path, toy_adapter: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    out = tmp_path / "ovms"
    assert (
        cli.main(
            ["serve", str(ov_base), "--name=base", f"--adapter=toy={toy_adapter}:0.5", f"--write-ovms-config={out}"]
        )
        == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert [g["name"] for g in config["mediapipe_config_list"]] == ["base", "toy"]
    base = (out / "base" / "graph.pbtxt").read_text()
    toy = (out / "toy" / "graph.pbtxt").read_text()
    for graph in (base, toy):
        assert 'calculator: "ImageGenCalculator"' in graph and f'models_path: "{ov_base.resolve()}"' in graph
        assert 'resolution: "64x64"' in graph and "num_images_per_prompt: 5" in graph
    assert "lora_adapters" not in base
    adapter = out / "adapters" / "toy.safetensors"
    assert f'lora_adapters: {{ alias: "toy" path: "{adapter.resolve()}" alpha: 0.5 }}' in toy
    keys = safe_open(str(adapter), "np").keys()  # noqa: SIM118 - a safe_open handle, not a dict
    assert keys and all(k.startswith("lora_unet_") for k in keys)  # the kohya layout GenAI applies
    assert cli.main(["serve", str(ov_base), f"--write-ovms-config={out}"]) == 2  # never over an existing config
    assert "plugin_config" not in base  # --precision auto: OpenVINO's default
    f32 = tmp_path / "ovms-f32"
    assert cli.main(["serve", str(ov_base), "--precision=f32", f"--write-ovms-config={f32}"]) == 0
    graph = (f32 / ov_base.name / "graph.pbtxt").read_text()
    assert """plugin_config: '{"INFERENCE_PRECISION_HINT": "f32"}'""" in graph


def test_a_request_without_guidance_gets_the_family_s_and_a_bad_one_is_refused_by_name() -> None:
    """The served family's guidance scale (FamilySpec.guidance_scale: Z-Image's pipeline uses 5.0) is a request's
    default, not SD's 7.5; a given one is kept, and one GenAI cannot run is refused naming the field."""
    from xeonsd.families import by_name
    from xeonsd.openvino.manifest import StaticShape
    from xeonsd.serve.requests import Limits, RequestError, validate

    shape = StaticShape(batch_size=1, height=64, width=64, num_images_per_prompt=1)
    limits = Limits(shape, ("base",), max_images=2, max_steps=50, guidance_scale=by_name("zimage").guidance_scale)
    assert validate({"prompt": "a robot"}, limits).guidance_scale == 5.0
    assert validate({"prompt": "a robot", "guidance_scale": 3}, limits).guidance_scale == 3.0
    with pytest.raises(RequestError, match="guidance_scale 1 is out of range"):
        validate({"prompt": "a robot", "guidance_scale": 1}, limits)


def test_auto_workers_is_one_per_core_share_within_the_memory() -> None:
    from xeonsd.serve.options import CORES_PER_WORKER, MEMORY_SHARE, PIPELINE_MEMORY, auto_workers

    assert auto_workers(8) == 8 // CORES_PER_WORKER
    assert auto_workers(1) == 1
    gib = 1 << 30
    fits = int(16 * gib * MEMORY_SHARE // (4 * gib * PIPELINE_MEMORY))
    assert auto_workers(64, weights=4 * gib, available=16 * gib) == fits < 64 // CORES_PER_WORKER
    assert auto_workers(64, weights=100 * gib, available=gib) == 1  # one worker, whatever the memory says


def _genai_stand_in(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """openvino_genai replaced by a stand-in that records each compile's properties (the list returned)."""
    import sys
    import types

    compiled: list[dict] = []

    class Pipe:
        def __init__(self, source: str | Pipe) -> None:
            self.source = source

        def reshape(self, *args) -> None:
            pass

        def compile(self, device: str, **props) -> None:
            compiled.append({"device": device, **props})

        def generate(self, *args, **kwargs) -> None:
            return None

    # One class stands for the three pipelines; one made from another (GenAI's shared models) compiles nothing.
    fake = types.SimpleNamespace(
        Text2ImagePipeline=Pipe,
        Image2ImagePipeline=Pipe,
        InpaintingPipeline=Pipe,
        AdapterConfig=lambda *a: a,
        TorchGenerator=lambda seed: seed,
    )
    monkeypatch.setitem(sys.modules, "openvino_genai", fake)
    return compiled


def test_each_worker_compiles_with_its_threads_and_the_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile properties GenAI gets (a stand-in records them): INFERENCE_NUM_THREADS, and with --precision f32
    the f32 hint (auto leaves OpenVINO's default: bf16 on AMX or AVX512-BF16)."""
    from xeonsd.families import by_name
    from xeonsd.openvino.manifest import StaticShape
    from xeonsd.serve.genai_pool import PipelinePool
    from xeonsd.serve.metrics import Metrics
    from xeonsd.serve.options import ServedModel

    compiled = _genai_stand_in(monkeypatch)
    served = ServedModel(Path("/x"), "base", by_name("sd"), StaticShape(1, 64, 64, 1), [])
    for precision, hint in (("f32", {"INFERENCE_PRECISION_HINT": "f32"}), ("auto", {})):
        compiled.clear()
        pool = PipelinePool(served, workers=2, threads=3, queue=1, metrics=Metrics(), precision=precision)
        pool._compile_one(0, {})
        pool._compile_one(1, {})
        assert compiled == [{"device": "CPU", "INFERENCE_NUM_THREADS": 3, **hint}] * 2, precision
    from xeonsd.serve.options import ServeError, ServeOptions, check_options

    with pytest.raises(ServeError, match="--precision 'f16': choose one of auto, f32"):
        check_options(ServeOptions(export_dir=Path("x"), precision="f16"))


def test_workers_auto_budgets_every_compile_a_worker_makes(monkeypatch: pytest.MonkeyPatch) -> None:
    """--workers auto counts the compiled copies a worker holds (options.compiled_copies) as the pool compiles them,
    for every family, batch, adapter and --blend count (edits' pipelines share models on some), so memory is not
    over-committed."""
    from xeonsd.families import REGISTRY
    from xeonsd.openvino.manifest import StaticShape
    from xeonsd.serve.genai_pool import PipelinePool
    from xeonsd.serve.metrics import Metrics
    from xeonsd.serve.options import ServedModel, auto_workers, compiled_copies

    compiled = _genai_stand_in(monkeypatch)
    seen = set()
    two = {"a": (Path("a"), 1.0), "b": (Path("b"), 0.5)}
    blends = ((("a", 0.7), ("b", 0.3)), (("a", 0.5),))  # --blend @a:0.7+@b:0.3 --blend @a:0.5
    for family in REGISTRY:
        for per_prompt in (1, 2):
            for adapters, declared in (({}, ()), (two, ()), (two, blends)):
                served = ServedModel(Path("/x"), "base", family, StaticShape(1, 64, 64, per_prompt), [])
                served.adapters, served.blends = dict(adapters), declared
                compiled.clear()
                pool = PipelinePool(served, workers=1, threads=1, queue=1, metrics=Metrics(), precision="auto")
                pool._compile_one(0, {n: (f"adapter {n}", alpha) for n, (_, alpha) in adapters.items()})
                configs = [c.get("adapters") for c in compiled]  # each blend: its adapters at its weights
                assert all(([(f"adapter {n}", w) for n, w in key],) in configs for key in declared), configs
                assert len(compiled) == compiled_copies(served), (family, per_prompt, sorted(adapters), declared)
                seen.add(len(compiled))
    assert len(seen) > 3, seen  # the count depends on the family, the batch, the adapters and the blends
    gib = 1 << 30
    assert auto_workers(16, gib, 32 * gib, copies=3) < auto_workers(16, gib, 32 * gib, copies=1)
