"""What ``serve.yml`` serves, defined once: the run it deploys, the adapters it registers and the ``xeonsd serve``
command line that carries them.

The serve role (``plugins/filter/xeonsd_serve.py`` loads this module on the controller) hands it what it read on
the primary: each run's real directory and ``train_summary.json`` (:mod:`.run_files`), and the export the served
run's ``openvino`` link names. It gets back the plan, or a :class:`ServePlanError` that names the variable to fix:

* :func:`run_dir`: ``serve_run`` (``latest``, a run's name under ``runs_dir``, or an absolute path) as a path;
* :func:`adapter_runs`: ``serve_adapters`` (``{name: run}`` or ``{name: {run, alpha}}``) checked and in order;
* :func:`plan`: the export to serve, the base model's name in requests, a textual inversion run's concept and the
  LoRA files to register by name (``{export, engine, name, method, base_model_fingerprint, embeds, token, adapters: [{name,
  run, path, alpha}], blends, files}``); ``blends`` are ``serve_blends`` checked (:func:`blend_args`); ``files``
  what every serving node needs besides the export;
* :func:`serve_argv`: ``xeonsd serve EXPORT [--engine torch] --embeds FILE --token TOKEN --adapter NAME=PATH:ALPHA … --blend …
  --host … --port …`` of a plan.

Standard library only (the filter plugins import it; so is :mod:`xeonsd.serve.requests`, whose blend parser
:func:`blend_args` uses).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Any

from xeonsd.contracts.method_names import METHOD_FILES, run_adapter

# An adapter's name is what a client sends as ``model``: it must survive NAME=PATH[:ALPHA] on the command line.
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# A run's name under runs_dir (what finetune_run_id makes, or latest).
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# xeonsd serve's settings that serve_argv turns into flags, by flag name (the role's serve_<name> variables).
SERVE_FLAGS = (
    "name",
    "host",
    "port",
    "workers",
    "queue",
    "timeout",
    "max-images",
    "drain",
    "precision",
    "api-key-file",
    "allow-from",
    "max-body-bytes",
    "read-timeout",
    "rate-limit",
)


class ServePlanError(ValueError):
    """A serve.yml setting or run that cannot be served, said with what to fix."""


def run_dir(run: Any, runs_dir: str, variable: str = "serve_run") -> str:
    """``run`` (``latest``, a run's name under ``runs_dir``, or an absolute path) as the run's directory."""
    text = str(run or "").strip()
    if text.startswith("/"):
        return posixpath.normpath(text)
    if not RUN_NAME.match(text) or text in (".", ".."):
        raise ServePlanError(
            f"{variable} is {run!r}: it is latest, the name of a run under {runs_dir} (e.g. 20261203-0812) or an "
            f"absolute path. Fix: set {variable} to one of those."
        )
    return posixpath.join(runs_dir, text)


def _alpha(value: Any, name: str) -> float:
    try:
        alpha = float(value)
    except (TypeError, ValueError):
        alpha = float("nan")
    if not alpha == alpha or alpha <= 0 or alpha > 10:  # NaN, or out of range
        raise ServePlanError(
            f"serve_adapters: {name}'s alpha is {value!r}: the adapter's weight is a number above 0, at most 10. "
            f"Fix: set serve_adapters.{name}.alpha to e.g. 1.0."
        )
    return alpha


def adapter_name(name: Any, variable: str = "serve_adapters") -> str:
    """``name`` checked as an adapter's name (what a client sends as ``model``)."""
    text = str(name)
    if not ADAPTER_NAME.match(text):
        raise ServePlanError(
            f"{variable}: {text!r} is not an adapter name: letters, digits, '.', '_' and '-', starting with a letter "
            f"or digit, at most 64 characters. Fix: rename it."
        )
    return text


def adapter_runs(adapters: Any, default_alpha: Any = 1.0) -> list[dict[str, Any]]:
    """``serve_adapters`` as ``[{name, run, alpha}]`` in the mapping's order; a value is the run (as ``serve_run``
    takes it) or ``{run, alpha}``."""
    if adapters in (None, ""):
        return []
    if not isinstance(adapters, Mapping):
        raise ServePlanError(
            f"serve_adapters is {adapters!r}: it maps adapter names to runs, e.g. {{style-a: lora-0812, style-b: "
            f"{{run: lora-0901, alpha: 0.8}}}}. Fix: set it to such a mapping, or {{}}."
        )
    out = []
    for name, value in adapters.items():
        name = adapter_name(name)
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - {"run", "alpha"})
            if unknown or "run" not in value:
                raise ServePlanError(
                    f"serve_adapters: {name} is {dict(value)!r}: an adapter is a run, or {{run: RUN, alpha: WEIGHT}}"
                    + (f" (unknown key(s) {', '.join(unknown)})" if unknown else " (no run)")
                    + f". Fix: set serve_adapters.{name}."
                )
            run, alpha = value["run"], value.get("alpha", default_alpha)
        else:
            run, alpha = value, default_alpha
        if str(run or "").strip() == "":
            raise ServePlanError(f"serve_adapters: {name} names no run. Fix: set serve_adapters.{name} to a run.")
        out.append({"name": name, "run": str(run), "alpha": _alpha(alpha, name)})
    return out


def _method(summary: Mapping[str, Any], where: str) -> str:
    method = summary.get("method")
    if method not in METHOD_FILES:
        raise ServePlanError(f"{where}/train_summary.json names no known method ({method!r}): is it an xeonsd run?")
    return method


def _adapter(adapter: Mapping[str, Any], served: Mapping[str, Any], alpha: Any) -> dict[str, Any]:
    """One serve_adapters entry (``{name, dir, summary, alpha}``) checked against the served run: a LoRA run of its
    base model."""
    name, adir, summary = adapter["name"], adapter["dir"], adapter["summary"]
    if _method(summary, adir) != "lora":
        raise ServePlanError(
            f"serve_adapters: {name} names {adir}, a {summary['method']} run, not LoRA. Fix: name a LoRA run."
        )
    if (kind := run_adapter(summary)) != "lora":
        raise ServePlanError(
            f"serve_adapters: {name} ({adir}) is a {kind} run: GenAI applies plain LoRA per request, not {kind}. "
            f"Fix: name runs trained with finetune_adapter=lora, and serve the {kind} run on its own (-e "
            f"serve_run={adir}: export.yml fused it into its own export)."
        )
    if summary.get("base_model_fingerprint", "") != served["summary"].get("base_model_fingerprint", ""):
        raise ServePlanError(
            f"serve_adapters: {name} ({adir}) was trained on another base model than serve_run {served['dir']} "
            f"({summary.get('base_model')} vs {served['summary'].get('base_model')}). Fix: name LoRA runs of the "
            "served run's base."
        )
    return {
        "name": name,
        "run": adir,
        "path": posixpath.join(adir, summary["result"]["path"]),
        "alpha": _alpha(adapter.get("alpha", alpha), name),
    }


def _fused_adapter(summary: Mapping[str, Any], where: str, torch_family: str) -> str:
    """A LoRA run's adapter type where it is not plain LoRA (``--adapter`` dora, lokr, loha), else ''. GenAI applies
    B A only, so export.yml fuses such a run into an export of its own, served alone; the PyTorch engine loads a
    DoRA per request as diffusers does, and cannot switch peft's LoKr/LoHa (it merges them: export.yml's images)."""
    kind = run_adapter(summary)
    if kind == "lora" or (torch_family and kind == "dora"):
        return ""
    if torch_family:
        raise ServePlanError(
            f"serve_run {where} is a {kind} run of {torch_family}, which the PyTorch engine serves with its "
            f"adapters switched per request by diffusers, which reads no {kind} (peft's layout); export.yml's images "
            "have it merged (xeonsd generate --engine torch --lora). Fix: serve a run trained with "
            "finetune_adapter=lora or dora."
        )
    return kind


def plan(
    served: Mapping[str, Any],
    export_dir: str,
    adapters: Sequence[Mapping[str, Any]] = (),
    *,
    alpha: Any = 1.0,
    fused_family: str = "",
    blends: Any = (),
    torch_family: str = "",
    inference: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The plan of a served run and its adapters.

    ``served``: ``{dir, summary}`` of the served run (its real directory and train_summary.json); ``export_dir``:
    the real directory of its OpenVINO export (empty: not exported); ``adapters``: ``{name, dir, summary, alpha}``
    of each serve_adapters entry (:func:`adapter_runs`, with the run's directory and summary read). A LoRA run is
    registered under its directory's name with ``alpha``; a full fine-tune serves its own export and takes no
    adapters (they were trained on the base model). A textual inversion run serves the base model's export (its
    ``openvino`` link, as a LoRA run's) with its learned embeddings (``embeds``, and the ``token`` its summary
    records) added at start-up (``xeonsd serve --embeds``): the base with the concept answers under the run's name,
    and serve_adapters' LoRA runs of the same base are registered beside it (each knows the concept too).
    ``fused_family``: the family's name where GenAI applies no adapters to it (SD3, Z-Image): a
    LoRA run's export then has its adapter fused in (export.yml), and it is served alone, like a full fine-tune's;
    so is a DoRA, LoKr or LoHa run's (``adapter`` in its summary) of every family GenAI serves: GenAI applies plain
    LoRA only, and export.yml fused it.
    ``blends``: ``serve_blends``, checked against the registered adapters (:func:`blend_args`).
    ``torch_family``: the family's label where optimum-intel has no OpenVINO export for it (FLUX.1 Kontext,
    Qwen-Image-Edit-2511, Krea 2; ``FamilySpec.ov_pipeline_class`` empty): the run is served on the PyTorch engine
    (``engine``: ``torch``) from a pipeline directory, the base model's (a LoRA or textual inversion run) or the
    run's own (a full fine-tune), as export.yml made its images; ``export_dir`` is not read.
    ``inference``: ``{dir, given, pipeline, family}``, the pipeline directory a LoRA or textual inversion run of such
    a family is served on in place of its base model (Krea 2 Turbo for a LoRA trained on RAW): serve_inference_model
    (``given``), else the ``inference_model`` the run rendered its validation images on; ``pipeline`` its
    model_index.json's class ('' where it has none) and ``family`` that class's family label ('' where none is)."""
    where = served["dir"]
    method = _method(served["summary"], where)
    export_dir = _served_dir(served, export_dir, method, torch_family)
    if inference:
        export_dir = _inference_dir(inference, where, method, torch_family) or export_dir
    fused_kind = _fused_adapter(served["summary"], where, torch_family)
    fingerprint = served["summary"].get("base_model_fingerprint", "")
    run_name = posixpath.basename(where.rstrip("/"))
    registered: list[dict[str, Any]] = []
    embeds, token = None, None
    if method == "textual_inversion":  # the concept on the base model's export; LoRA runs of that base beside it
        embeds = posixpath.join(where, served["summary"]["result"]["path"])
        token = next(iter(served["summary"].get("placeholder_tokens") or ()), None)
    elif method == "lora" and not fused_family and not fused_kind:
        registered.append(
            {
                "name": adapter_name(run_name, "serve_run's name"),
                "run": where,
                "path": posixpath.join(where, served["summary"]["result"]["path"]),
                "alpha": _alpha(alpha, "serve_run"),
            }
        )
    elif adapters:
        _refuse_adapters(where, method, fused_family, fused_kind)
    for adapter in adapters:
        if adapter["name"] in (r["name"] for r in registered) or (embeds and adapter["name"] == run_name):
            raise ServePlanError(
                f"serve_adapters: {adapter['name']} is registered twice (serve_run's "
                f"{'concept' if embeds else 'adapter'} takes its run's name). Fix: rename it."
            )
        registered.append(_adapter(adapter, served, alpha))
    return {
        "export": export_dir,
        "engine": "torch" if torch_family else "genai",
        "name": _base_name(served["summary"], run_name, registered, concept=embeds is not None),
        "method": method,
        "base_model_fingerprint": fingerprint,
        "embeds": embeds,
        "token": token,
        "adapters": registered,
        "blends": blend_args(blends, registered),
        "files": sorted({r["path"] for r in registered} | ({embeds} if embeds else set())),
    }


def _refuse_adapters(where: str, method: str, fused_family: str, fused_kind: str) -> None:
    """serve_adapters beside a run served alone from its own export: a fused LoRA's, a full fine-tune's."""
    if fused_kind:
        raise ServePlanError(
            f"serve_run {where} is a {fused_kind} run: GenAI applies plain LoRA only, so its export has the run's "
            f"{fused_kind} adapter fused in and serves no others. Fix: serve_adapters={{}}, and serve each "
            f"{fused_kind} run on its own (-e serve_run=RUN)."
        )
    if method == "lora":
        raise ServePlanError(
            f"serve_run {where} is a {fused_family} LoRA run: GenAI applies no adapters to {fused_family}, so its "
            "export has the run's adapter fused in and serves no others. Fix: serve_adapters={}, and serve each "
            f"{fused_family} LoRA run on its own (-e serve_run=RUN)."
        )
    raise ServePlanError(
        f"serve_run {where} is a full fine-tune (its own pipeline); serve_adapters' LoRA adapters were trained "
        "on the base model. Fix: serve a LoRA run of that base (-e serve_run=RUN), or serve_adapters={}."
    )


def _served_dir(served: Mapping[str, Any], export_dir: str, method: str, torch_family: str) -> str:
    """What ``xeonsd serve`` is given: the export, or for a family without one the pipeline (:func:`_pipeline_dir`)."""
    where = served["dir"]
    if torch_family:
        return _pipeline_dir(served["summary"], where, method, torch_family)
    if not export_dir:
        raise ServePlanError(
            f"serve_run {where} has no OpenVINO export ({where}/openvino): run export.yml on it first "
            f"(ansible-playbook export.yml -e openvino_export_run_dir={where})."
        )
    return export_dir


def _inference_dir(inference: Mapping[str, Any], where: str, method: str, torch_family: str) -> str | None:
    """The pipeline directory a torch-engine run is served on in place of its base model (None: the base), checked:
    a pipeline of the run's family, for a LoRA or textual inversion run of a family without an OpenVINO export. A
    run's own ``inference_model`` where it does not apply is left alone; ``serve_inference_model`` is refused."""
    given, path = bool(inference.get("given")), str(inference["dir"])
    name = "serve_inference_model" if given else f"the run's inference_model ({where}/train_summary.json)"
    if not torch_family or method == "full":
        if given:
            what = (
                "a full fine-tune, served from its own pipeline" if torch_family else "served from its OpenVINO export"
            )
            raise ServePlanError(
                f"serve_inference_model {path}: serve_run {where} is {what}; serve_inference_model replaces the base "
                "model of a LoRA or textual inversion run of a family without an OpenVINO export (Krea 2: Turbo). "
                "Fix: leave serve_inference_model empty."
            )
        return None
    if not path.startswith("/"):
        raise ServePlanError(
            f"{name} {path!r} is no absolute path: the PyTorch engine serves a pipeline directory that every node "
            "gets a copy of. Fix: -e serve_inference_model=DIR, a copy of that pipeline on the primary."
        )
    if not inference.get("pipeline"):
        raise ServePlanError(f"{name} {path} holds no model_index.json on the primary: it is no diffusers pipeline")
    if inference.get("family") != torch_family:
        found = f"a {inference['family']}" if inference.get("family") else "no supported family's"
        raise ServePlanError(
            f"{name} {path} is {found} pipeline ({inference['pipeline']}), and serve_run {where} is a {torch_family} "
            f"run: its adapter fits {torch_family} only. Fix: name a {torch_family} pipeline (for a Krea 2 RAW run, "
            "Krea 2 Turbo), or leave serve_inference_model empty to serve it on its base model."
        )
    return posixpath.normpath(path)


def _pipeline_dir(summary: Mapping[str, Any], where: str, method: str, label: str) -> str:
    """The diffusers pipeline directory the torch engine serves: a full fine-tune's own, else the base model's, which
    must be a directory (every node gets a copy at the same path)."""
    if method == "full":
        return posixpath.dirname(posixpath.join(where, summary["result"]["path"]))
    base = str(summary.get("base_model", ""))
    if not base.startswith("/"):
        raise ServePlanError(
            f"serve_run {where} is a {label} run, which the PyTorch engine serves from its base model's pipeline "
            f"directory (optimum-intel has no OpenVINO export for {label}), and its base_model {base!r} is no "
            "absolute path. Fix: train from a local copy of the base model (finetune.yml's base model as a directory)."
        )
    return posixpath.normpath(base)


def _base_name(
    summary: Mapping[str, Any], run_name: str, registered: Sequence[Mapping[str, Any]], concept: bool
) -> str | None:
    """The base's name in requests: the base model's (its directory or Hub name) under a LoRA run's adapters, the
    run's own for its own export (a full fine-tune, a fused LoRA) and for the base holding a textual inversion run's
    concept (the concept is what is served); None (xeonsd serve's default, the export directory's name) where it is
    no valid model name."""
    base = posixpath.basename(str(summary.get("base_model", "")).rstrip("/"))
    name = base if registered and not concept else run_name
    return name if ADAPTER_NAME.match(name) and name not in (r["name"] for r in registered) else None


def blend_args(blends: Any, registered: Sequence[Mapping[str, Any]]) -> list[str]:
    """``serve_blends`` (OVMS composites, ``@NAME:WEIGHT+@NAME:WEIGHT``) checked by ``xeonsd serve --blend``'s own
    parser (:func:`xeonsd.contracts.blend_syntax.parse_blends`) against the registered adapters'
    names and alphas; each as its normal form (parts sorted by name), for ``--blend``."""
    if blends in (None, ""):
        return []
    if isinstance(blends, (str, Mapping)) or not isinstance(blends, Sequence):
        raise ServePlanError(
            f"serve_blends is {blends!r}: it is a list of LoRA blends, e.g. ['@style-a:0.7+@style-b:0.3']. "
            "Fix: set serve_blends to such a list, or []."
        )
    from xeonsd.contracts.blend_syntax import BlendError, composite, parse_blends

    alphas = {r["name"]: float(r["alpha"]) for r in registered}
    try:
        keys = parse_blends(tuple(str(b) for b in blends), alphas)
    except BlendError as e:
        raise ServePlanError(
            f"serve_blends: {e}. Fix: blend only the adapters served here ({', '.join(alphas) or 'none'}: "
            "serve_run's LoRA and serve_adapters), each once, weights within -4..4; or add the adapter to "
            "serve_adapters."
        ) from None
    return [composite(k) for k in keys]


def serve_argv(served: Mapping[str, Any], settings: Mapping[str, Any]) -> list[str]:
    """``["serve", EXPORT, "--embeds", FILE, "--token", TOKEN, "--adapter", "NAME=PATH:ALPHA", …, "--blend", BLEND, …,
    "--name", …]`` of a plan; ``settings`` has the flags of :data:`SERVE_FLAGS` (``max-images`` also as
    ``max_images``); an empty one is left to xeonsd's default (``name``: the plan's)."""
    argv = ["serve", served["export"]]
    if served.get("engine", "genai") != "genai":
        argv += ["--engine", served["engine"]]
    if served.get("embeds"):
        argv += ["--embeds", served["embeds"]]
        if served.get("token"):
            argv += ["--token", served["token"]]
    settings = {"name": served.get("name") or "", **{k: v for k, v in settings.items() if v not in (None, "")}}
    for adapter in served["adapters"]:
        argv += ["--adapter", f"{adapter['name']}={adapter['path']}:{float(adapter['alpha']):g}"]  # NAME=PATH:ALPHA
    for blend in served.get("blends", ()):
        argv += ["--blend", blend]
    unknown = sorted(set(settings) - {*SERVE_FLAGS, *(f.replace("-", "_") for f in SERVE_FLAGS)})
    if unknown:
        raise ServePlanError(f"unknown xeonsd serve setting(s) {', '.join(unknown)}; known: {', '.join(SERVE_FLAGS)}")
    for flag in SERVE_FLAGS:
        value = settings.get(flag, settings.get(flag.replace("-", "_")))
        if value is not None and str(value) != "":
            argv += [f"--{flag}", str(value)]
    return argv
