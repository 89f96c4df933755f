"""xeonsd_train_argv: the `xeonsd train` argument list of the chosen method, from the `finetune_<flag>` variables.

The flags are `xeonsd train`'s own, read from the trainer's configuration (``train/src/xeonsd/trainer/config.py``,
standard library only): each flag NAME is set by the variable ``finetune_NAME`` when it is defined, so a flag the
trainer gains reaches the playbooks with no YAML edit (``-e finetune_max_train_steps=400``). finetune.yml looks up
the variables xeonsd_train_vars names for the method and hands their values to xeonsd_train_argv:

    finetune_train_argv: "{{ finetune_train_vars | zip(query('vars', *finetune_train_vars, default=''))
                            | xeonsd_train_argv(finetune_method, finetune_extra_args) }}"

`xeonsd train` refuses a flag of another method than ``--method``, so the list carries ``--method`` first, then
the flags of every method and of that method only; finetune.yml's job and doctor.yml's one-step trial both use it.
A boolean flag is the bare flag when true (``--no-NAME`` when false for a flag that defaults to on); an empty,
None or false value leaves the flag out (the trainer's default); a flag that needs another (``needs`` in the
trainer's table: the prior-preservation group, --keep_tokens) is left out while that one is off; anything else is
``--NAME=value``.

xeonsd_method: what a method leaves in the run directory (its result file, what people call it, whether it is a
whole pipeline, its `xeonsd generate` flag); xeonsd_result_export: how a run's result reaches its images (the
export it gets and the generate arguments that load the result onto it, or, for a family optimum-intel has no
OpenVINO export for, no export and the PyTorch engine's generate arguments).

The methods and their files are defined once, in the package's ``train/src/xeonsd/contracts/method_names.py``, and
what GenAI applies per family in ``train/src/xeonsd/families/`` (the specs and registry: standard library only),
which this plugin imports from the controller's venv.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ansible.module_utils.parsing.convert_bool import boolean

from xeonsd import families

# xeonsd's standard-library-only parts, from the controller's venv (`make install`: see plugins/README.md).
from xeonsd.contracts import method_names
from xeonsd.trainer import config as train_config

METHODS: tuple[str, ...] = method_names.METHODS
METHOD_FILES: dict[str, dict] = method_names.METHOD_FILES


class TrainArgvError(ValueError):
    """A method or flag group the trainer does not know."""


PREFIX = "finetune_"  # the variable of flag NAME is finetune_NAME


def _fields(method: str) -> list[dataclasses.Field]:
    """The trainer's flags that ``method`` takes (every method's and its own), ``--method`` itself aside."""
    if method not in METHODS:
        raise TrainArgvError(f"finetune_method {method!r}: choose one of {', '.join(METHODS)}")
    fields = dataclasses.fields(train_config.TrainConfig)
    return [f for f in fields if f.name != "method" and method in (f.metadata.get("methods") or (method,))]


def train_vars(method: str) -> list[str]:
    """The variables that set ``method``'s flags: ``finetune_NAME`` for each."""
    return [PREFIX + f.name for f in _fields(method)]


def _on(value: Any) -> bool:
    return boolean(value, strict=False) if isinstance(value, (str, bool, int)) else bool(value)


def train_argv(values: Iterable[Any], method: str, extra: Sequence[str] = ()) -> list[str]:
    """``["--method=M", <the flags of M whose finetune_NAME is set>, *extra]`` from ``values``, a mapping or the
    (name, value) pairs of the variables (see the module's docstring)."""
    given = dict(values)
    argv = [f"--method={method}"]
    for f in _fields(method):
        value = given.get(PREFIX + f.name)
        needs = f.metadata.get("needs")
        if value is None or value == "" or (needs and not _on(given.get(PREFIX + needs))):
            continue
        if f.type in (bool, "bool", "bool | None"):  # bool | None: left out (""), on or off
            if _on(value):
                argv.append(f"--{f.name}")
            elif f.metadata.get("negatable") and f.default is not False:
                argv.append(f"--no-{f.name}")
        elif value is not False:
            argv.append(f"--{f.name}={value}")
    return argv + [str(a) for a in extra]


def method(name: str, adapter: str = "lora", save_format: str = "diffusers") -> dict:
    """``{"name", "result", "what", "pipeline", "generate_flag", "files"}`` of the method ``name`` (``files``: what
    is fetched; LoRA's ``adapter`` lokr or loha leaves peft's layout, its weights the result; its ``save_format``
    comfyui adds ComfyUI's file)."""
    if name not in METHODS:
        raise TrainArgvError(f"finetune_method {name!r}: choose one of {', '.join(METHODS)}")
    if adapter not in method_names.ADAPTERS:
        raise TrainArgvError(f"finetune_adapter {adapter!r}: choose one of {', '.join(method_names.ADAPTERS)}")
    info = {"name": name, **METHOD_FILES[name]}
    info["files"] = [info["result"]]
    if name == "lora" and adapter in method_names.PEFT_ADAPTERS:
        files = list(method_names.PEFT_FILES)
        info.update(result=files[0], files=files, what=f"{adapter} adapter (peft layout)", generate_flag=None)
    if name == "lora" and save_format == "comfyui":
        info["files"] = [*info["files"], method_names.COMFYUI_FILE]
    return info


def result_export(
    summary: Mapping[str, Any], run_dir: str, lora_scale: Any = 1.0, torch_args: Sequence[str] = ()
) -> dict[str, Any]:
    """How a finished run (train_summary.json names its method, result file, base model and family) reaches its
    images: ``{"export", "own", "source", "args", "generate_args", "why"}``.

    * a family optimum-intel has no OpenVINO export for (``FamilySpec.ov_pipeline_class`` empty: FLUX.1 Kontext,
      Qwen-Image-Edit, FLUX.2 [dev], Krea 2): no ``export``; ``xeonsd generate SOURCE`` (the base model, or the
      ``inference_model`` the run rendered its validation images on) runs the family's diffusers pipeline with
      ``generate_args`` ``--engine torch``, ``torch_args`` (the size and calls an export would have had:
      xeonsd_generate_shape_args), the result's flag (``--lora`` for every adapter type: the engine merges a LoKr or
      LoHa; a full fine-tune is ``source`` itself) and ``--image`` for
      each reference image the run's validation images were edits of (train_summary.json's ``sample_references``);
    * a whole pipeline (full) is exported itself: ``own``, ``source`` the run;
    * a LoRA of a family whose adapters GenAI does not apply (``FamilySpec.genai_adapters``: SD3, Z-Image), and a
      DoRA, LoKr or LoHa run of any family (``adapter`` in the summary; GenAI applies plain LoRA only), is fused into
      an export of its own: ``own``, ``source`` the base model, ``args`` ``--lora FILE --lora-scale S`` (FILE a
      LoKr/LoHa run's ``adapter_model.safetensors``, beside its config);
    * otherwise the result loads onto the base model's shared export at generation time: ``generate_args``
      ``--embeds FILE`` or ``--lora FILE:SCALE``.

    And ``before``, the report's before row, the base model at the same seeds without the result: ``{"source",
    "generate_args", "engine"}``; ``source`` None is the base model's export the result loads onto (the after
    row's export without the result's flag). A run with an export of its own (full, fused) has no base export to
    compare with: the base model's diffusers pipeline in PyTorch draws its before row, at the export's size.
    """
    route = _route(summary, run_dir, lora_scale, torch_args)
    torch_before = ["--engine", "torch", *map(str, torch_args)]
    if not route["export"]:  # the same engine, model and references, without the result
        before = {"source": str(summary.get("inference_model") or summary["base_model"]), "engine": "torch"}
        before["generate_args"] = torch_before + _references(summary)
    elif route["own"]:
        before = {"source": str(summary["base_model"]), "generate_args": torch_before, "engine": "torch"}
    else:
        before = {"source": None, "generate_args": [], "engine": "openvino"}
    return {**route, "before": before}


def _route(summary: Mapping[str, Any], run_dir: str, lora_scale: Any, torch_args: Sequence[str]) -> dict[str, Any]:
    """:func:`result_export` without its ``before``."""
    kind = method_names.run_adapter(summary)
    info = method(summary["method"], kind)
    try:
        found = families.of_run(summary, run_dir)
    except families.FamilyError as e:
        raise TrainArgvError(str(e)) from None
    path = f"{run_dir}/{summary['result']['path']}"
    flag = info["generate_flag"] or ("--lora" if summary["method"] == "lora" else None)  # LoKr/LoHa: peft's file
    arg = f"{path}:{lora_scale}" if flag == "--lora" else path
    if not found.ov_pipeline_class:
        references = _references(summary)
        return {
            "export": False,
            "own": False,
            # the model the run's validation images were rendered on (Krea 2: Turbo for a LoRA trained on RAW)
            "source": run_dir if info["pipeline"] else str(summary.get("inference_model") or summary["base_model"]),
            "args": [],
            "generate_args": [
                "--engine",
                "torch",
                *map(str, torch_args),
                *([] if info["pipeline"] else [flag, arg]),
                *references,
            ],  # fmt: skip
            "why": f"no OpenVINO export: optimum-intel has none for {found.label}; the images are its diffusers "
            "pipeline's, in PyTorch",
        }
    if info["pipeline"]:
        return {
            "export": True,
            "own": True,
            "source": run_dir,
            "args": [],
            "generate_args": [],
            "why": "its own pipeline",
        }
    if flag == "--lora" and (kind != "lora" or not found.genai_adapters):
        return {
            "export": True,
            "own": True,
            "source": str(summary["base_model"]),
            "args": ["--lora", path, "--lora-scale", str(lora_scale)],
            "generate_args": [],
            "why": f"the LoRA fused into the base model: GenAI applies no adapters to {found.label}"
            if kind == "lora"
            else f"the {kind} adapter fused into the base model: GenAI applies plain LoRA only",
        }
    return {
        "export": True,
        "own": False,
        "source": str(summary["base_model"]),
        "args": [],
        "generate_args": [flag, arg],
        "why": "",
    }


def _references(summary: Mapping[str, Any]) -> list[str]:
    """``--image REF`` for each reference image the run's validation images were edits of."""
    return [a for ref in summary.get("sample_references") or () for a in ("--image", str(ref))]


class FilterModule:
    def filters(self) -> dict:
        return {
            "xeonsd_train_argv": train_argv,
            "xeonsd_train_vars": train_vars,
            "xeonsd_method": method,
            "xeonsd_result_export": result_export,
        }
