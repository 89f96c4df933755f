"""``xeonsd report RUN_DIR``: one ``report.html`` a person can open, from what a run left in its directory.

It reads what is there and says what is missing: ``run.json`` (the exact command, versions, phase times, written
by whoever launched the run), ``metrics.jsonl``, ``loss.png`` and ``validation_grid.png`` (the trainer), ``images/`` with ``timings.json``
(``xeonsd generate``) and an export manifest (``xeonsd export``). Images are linked relatively, so the
directory can be moved or copied as a whole.

The order is what a reader asks first: did it work, what did it make, what did it cost. A status line (done,
stopped or failed; steps; wall time; images/s; cost), then a run told to stop says by what, at which step and how
to resume; the base model's images before training and the result's after, same seeds, each row's distance to the
training images (:mod:`xeonsd.ops.before_after`; without a before row, the generated images alone) and the validation images over the steps; the loss plot with the training figures;
the method; the cluster (its table, CPU use, the time split, stragglers, cost); the phase times and the export;
what the directory lacks; and last, folded, the command, the versions and the job script.
"""

from __future__ import annotations

import html
import json
import statistics
from pathlib import Path
from typing import Any

from xeonsd.contracts.method_names import METHOD_FILES
from xeonsd.contracts.run_files import TENSORBOARD_DIR, TRAINING_WALL
from xeonsd.families import SPECS
from xeonsd.fsutil import atomic_file
from xeonsd.jobs.progress import metrics_rows
from xeonsd.ops import before_after
from xeonsd.ops import run_view as clusterview
from xeonsd.ops.model_card import write_model_card
from xeonsd.ops.report_cluster import cluster_sections, figure, html_table
from xeonsd.ops.report_status import ended_attempt, status_line, stopped_section
from xeonsd.trainer.metrics import FINAL, GRID, PARTIAL, VALIDATION_LABEL, loss_curve, read_summary, validation_points

REPORT = "report.html"


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def training_summary(rows: list[dict]) -> dict[str, Any]:
    """Steps, first/last loss, the smoothed loss's trend, median s/step and throughput from the metrics rows."""
    if not rows:
        return {}
    timed = [r["s_per_step"] for r in rows[1:]] or [rows[0]["s_per_step"]]
    curve = loss_curve(rows)
    # The raw first and last values are mostly timestep noise; the EMA once it has a window of points, and at the
    # end, tell whether the loss went down.
    start = min(curve.window, len(curve.smooth)) - 1
    return {
        "steps": rows[-1]["step"],
        "ranks": rows[-1].get("ranks"),
        "backend": rows[-1].get("backend"),
        "first loss": round(rows[0]["loss"], 5),
        "last loss": round(rows[-1]["loss"], 5),
        f"loss {curve.label}": f"{curve.smooth[start]:.4f} at step {curve.steps[start]} → "
        f"{curve.smooth[-1]:.4f} at step {curve.steps[-1]}",
        **_validation_summary(rows),
        "median s/step": round(statistics.median(timed), 3),
        "images/s": round(statistics.median(r["images_per_s"] for r in rows[1:] or rows), 3),
        "all-reduce bytes/step": rows[-1].get("allreduce_bytes"),
        "training time (s)": round(sum(r["s_per_step"] for r in rows), 1),
    }


def _validation_summary(rows: list[dict]) -> dict[str, str]:
    """The validation loss's first, last and lowest points, when the run measured one."""
    val = validation_points(rows)
    if not val:
        return {}
    (s0, v0), (s1, v1) = val[0], val[-1]
    best_step, best = min(val, key=lambda p: p[1])
    return {VALIDATION_LABEL: f"{v0:.4f} at step {s0} → {v1:.4f} at step {s1}; lowest {best:.4f} at step {best_step}"}


# Distributions whose versions make a run reproducible (absent ones are left out).
STACK = (
    "xeonsd",
    "torch",
    "intel-extension-for-pytorch",
    "oneccl_bind_pt",
    "diffusers",
    "transformers",
    "accelerate",
    "impi-rt",
    "openvino",
    "openvino-genai",
    "openvino-tokenizers",
    "optimum-intel",
    "nncf",
)


def stack_versions() -> dict[str, str]:
    """Versions of the installed stack (the env that writes the report: the one that ran the job)."""
    import platform
    from importlib import metadata

    found = {"python": platform.python_version()}
    for name in STACK:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def _find_export_manifest(run: Path) -> dict | None:
    # openvino/ is a link to the base model's export for textual inversion and LoRA (glob does not follow it).
    for candidate in [run / "openvino" / "xeonsd_export.json", *sorted(run.glob("**/xeonsd_export.json"))]:
        if candidate.is_file():
            return _load_json(candidate)
    return None


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def _method_section(summary: dict, rows: list[dict], missing: list[str]) -> list[str]:
    """What trained (train_summary.json): the method, its trainable parameters, the result's size, the prompts
    (captions) used and the bytes each rank all-reduced per step."""
    if not summary:
        missing.append("train_summary.json (the method and its result)")
        return []
    method = summary.get("method", "?")
    data: dict[str, Any] = {"method": method}
    if summary.get("trainable_params") is not None:
        data["trainable parameters"] = f"{summary['trainable_params']:,}"
    if method == "lora":
        data["adapter type"] = summary.get("adapter", "lora")  # --adapter (a run before it: plain LoRA)
        data["LoRA rank, alpha"] = f"{summary.get('lora_rank')}, {summary.get('lora_alpha')}"
    if summary.get("placeholder_tokens"):
        data["concept token(s)"] = " ".join(summary["placeholder_tokens"])
    result = summary.get("result") or {}
    if result:
        what = METHOD_FILES.get(method, {}).get("what", "result")  # "LoRA adapter", …
        data[what] = f"{result.get('path')} · {_size(result.get('bytes', 0))}"
    prompts = summary.get("prompts") or {}
    if prompts:
        data["captions used"] = (
            f"{prompts['count']} captions from {prompts['source']}"
            if prompts.get("per_image")
            else f"none: {prompts['count']} prompt(s) from {prompts['source']}"
        )
    if column := summary.get("cond_image_column"):
        data["edit training on image pairs"] = (
            f"{len(summary.get('sample_references') or [])} reference image(s) per image (the metadata.jsonl field "
            f"{column})"
        )
    if summary.get("base_model"):
        data["base model"] = f"{summary['base_model']} (fingerprint {summary.get('base_model_fingerprint')})" + (
            f": {before_after.DEMO_NOTE}" if before_after.demo_base(summary) else ""
        )
    if summary.get("family"):
        at = f", {summary['resolution']} px" if summary.get("resolution") else ""
        known = SPECS.get(summary["family"])
        data["model family, resolution"] = f"{known.label if known else summary['family']}{at}"
    if sampling := flow_sampling(summary.get("loss") or {}):
        data["σ sampling (flow matching)"] = sampling
    counted = summary.get("allreduce_bytes_per_step")
    measured = next((r["allreduce_bytes_measured"] for r in rows if "allreduce_bytes_measured" in r), None)
    if counted is not None:
        data["all-reduced per step (per rank)"] = _size(counted) + (
            f" (measured {_size(measured)})" if measured is not None else ""
        )
    return ["<h2>Method</h2>" + html_table(data)]


def flow_sampling(loss: dict) -> str | None:
    """How a flow model's run drew σ, from train_summary.json's ``loss`` (``weighting_scheme`` and its parameters, as
    diffusers' scripts name them); None for a noise-prediction run."""
    scheme = loss.get("weighting_scheme")
    if not scheme:
        return None
    if scheme == "logit_normal":
        return f"logit_normal (mean {loss.get('logit_mean')}, std {loss.get('logit_std')})"
    if scheme == "mode":
        return f"mode (scale {loss.get('mode_scale')})"
    return str(scheme)


def _figures(run: Path, info: dict, rows: list[dict], timings: dict) -> dict:
    """The cluster figures, also written into run.json (when there is one) for scripts."""
    wall = (info.get("phases") or {}).get(TRAINING_WALL)
    ips = timings.get("images_per_s")
    figs = clusterview.figures(rows, info.get("cost") or {}, wall, 1 / ips if ips else None)
    if (run / "run.json").is_file() and info and info.get("cluster_figures") != figs:
        with atomic_file(run / "run.json", "w") as fh:
            fh.write(json.dumps({**info, "cluster_figures": figs}, indent=2) + "\n")
    return figs


def build_report(run: Path) -> str:
    """The HTML of RUN's report: one section after the other, then what the directory lacks."""
    trained = read_summary(run) or {}
    return _report_html(Path(run), trained, before_after.read(run, trained))


def _report_html(run: Path, trained: dict, pair: before_after.BeforeAfter | None) -> str:
    """:func:`build_report` of what train_summary.json holds (``trained``) and the before and after rows."""
    info = _load_json(run / "run.json") or {}
    missing: list[str] = []
    rows = metrics_rows(run, (FINAL, PARTIAL))
    images_dir = run / "images"
    timings = _load_json(images_dir / "timings.json") or {}
    figs = _figures(run, info, rows, timings)
    ended = ended_attempt(run)
    how = _how_it_ran(run, info, missing)  # last, but what it lacks goes into the list before it
    sections = [
        status_line(run, ended, info, rows, figs),
        *stopped_section(ended),
        *([before_after.section(pair)] if pair is not None else _images_section(images_dir, timings, missing)),
        *_validation_section(run),
        *_loss_section(run, rows, missing),
        *_method_section(trained, rows, missing),
        *(["<h2>Cluster</h2>" + html_table(info["cluster"])] if info.get("cluster") else []),
        *cluster_sections(rows, figs, trained.get("startup", {}).get("shared_weights_bytes")),
        *_phases_section(info, timings),
        *_export_section(run, info),
        *_missing_section(missing),
        *how,
    ]
    return _page(html.escape(info.get("title") or f"xeonsd run {run.name}"), sections)


def _how_it_ran(run: Path, info: dict, missing: list[str]) -> list[str]:
    """Last and folded: the command, the versions of the stack and the job script (run.sh)."""
    command = info.get("command")
    script = run / "run.sh"
    if not command and not script.is_file():
        missing.append("run.json or run.sh (the command)")
    folds = [
        ("Command", f"<pre>{html.escape(str(command))}</pre>" if command else ""),
        ("Versions", html_table(info.get("versions") or stack_versions())),
        ("Job script (run.sh)", f"<pre>{html.escape(script.read_text())}</pre>" if script.is_file() else ""),
    ]
    body = "".join(f"<details><summary>{name}</summary>{text}</details>" for name, text in folds if text)
    return ["<h2>How it ran</h2>" + body]


def _loss_section(run: Path, rows: list[dict], missing: list[str]) -> list[str]:
    """The loss plot (training and validation) and the training figures under it."""
    sections = []
    summary = training_summary(rows)
    if not summary:
        missing.append("metrics.jsonl")
    if (run / "loss.png").is_file():
        caption = (
            "Faint: the loss of each step, mostly the noise of the sampled timesteps. Bold: the trend, the "
            f"exponential moving average of the loss: {loss_curve(rows).label}."
            + (
                " Green: the loss on images held out of training, at the same timesteps and noise every time: "
                "where it turns up while the training loss goes on down, the run over-fits."
                if validation_points(rows)
                else ""
            )
            if rows
            else "The loss per step."
        )
        sections.append(
            "<h2>Loss</h2>" + figure("loss.png", "loss per step and its moving average", html.escape(caption))
        )
    else:
        missing.append("loss.png")
        if summary:
            sections.append("<h2>Loss</h2>")
    if summary:
        sections.append(html_table(summary))
    if any((run / TENSORBOARD_DIR).glob("events.out.tfevents.*")):
        sections.append(
            f"<p>TensorBoard: the curves, the CPU use per node and the validation images are in "
            f"<code>{TENSORBOARD_DIR}/</code>; open them with <code>tensorboard --logdir {html.escape(str(run.parent))}"
            "</code> (every run beside this one) and http://localhost:6006.</p>"
        )
    return sections


def _validation_section(run: Path) -> list[str]:
    """The validation prompt's images over the steps (the trainer's grid), when the run rendered them."""
    if not (run / GRID).is_file():
        return []
    caption = (
        "The validation prompt's images (one row per image, the same seed in every column) at every "
        "--validation_steps evaluation and at the end."
    )
    return ["<h2>Validation images</h2>" + figure(GRID, "validation images over the steps", caption)]


def _phases_section(info: dict, timings: dict) -> list[str]:
    """run.json's phase times and the generation's load, compile and throughput figures."""
    phases = dict(info.get("phases") or {})
    for key in ("load_s", "compile_s", "first_image_s", "images_per_s"):
        if key in timings:
            phases[f"generate: {key}"] = timings[key]
    return ["<h2>Throughput per phase</h2>" + html_table(phases)] if phases else []


def _export_section(run: Path, info: dict) -> list[str]:
    """The export manifest's scalar fields, and whether this run made the export or reused it."""
    manifest = _find_export_manifest(run)
    if not manifest:
        return []
    shown = {k: v for k, v in manifest.items() if not isinstance(v, dict | list)}
    export = info.get("export") or {}
    if export:
        how = "reused (made by an earlier run)" if export.get("reused") else "made by this run"
        shown = {"export of": export.get("of"), "directory": export.get("dir"), "this run": how, **shown}
    return ["<h2>OpenVINO export</h2>" + html_table(shown)]


def _images_section(images_dir: Path, timings: dict, missing: list[str]) -> list[str]:
    """The generated images (linked relatively) under their prompt."""
    pictures = sorted(p for p in images_dir.glob("*.png") if p.name != "grid.png") if images_dir.is_dir() else []
    if not pictures:
        missing.append("images/*.png")
        return []
    figs = "".join(figure(f"images/{name}", name, name) for name in (html.escape(p.name) for p in pictures))
    prompt = timings.get("prompts") or timings.get("prompt")
    prompts = [str(p) for p in prompt] if isinstance(prompt, list) else [str(prompt)] if prompt else []
    quoted = ", ".join(f"<q>{html.escape(p)}</q>" for p in dict.fromkeys(prompts))  # each distinct prompt once
    caption = f"<p>Prompt{'s' if len(set(prompts)) > 1 else ''}: {quoted}</p>" if prompts else ""
    return [f"<h2>Generated images</h2>{caption}<div class=images>{figs}</div>"]


def _missing_section(missing: list[str]) -> list[str]:
    if not missing:
        return []
    items = "".join(f"<li>{html.escape(m)}</li>" for m in missing)
    return [f"<h2>Not in this run directory</h2><ul>{items}</ul>"]


def _page(title: str, sections: list[str]) -> str:
    style = (
        "body{font-family:sans-serif;max-width:70em;margin:2em auto;padding:0 1em;line-height:1.4}"
        "h1{font-size:1.6em;overflow-wrap:anywhere}"
        ".status{font-size:1.15em;padding:.6em .9em;border-radius:.4em;background:#eef6ee;border-left:.4em solid #3a3}"
        ".status.stopped{background:#fff6e5;border-color:#e90}.status.failed{background:#fdeeee;border-color:#c33}"
        "table{border-collapse:collapse;display:block;overflow-x:auto;max-width:100%}"
        "th,td{border:1px solid #ccc;padding:.2em .6em;text-align:left;vertical-align:top}"
        "pre{background:#f4f4f4;padding:.8em;white-space:pre-wrap;overflow-wrap:anywhere}"
        "figure{margin:0}img{max-width:100%;height:auto}figcaption{color:#555;font-size:.9em}"
        ".images{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(180px,45%),1fr));gap:1em}"
        ".images img{width:100%;image-rendering:pixelated}"
        "details{margin:.4em 0}summary{cursor:pointer;font-weight:bold}"
    )
    return (
        "<!doctype html><html><head><meta charset=utf-8>"
        '<meta name=viewport content="width=device-width,initial-scale=1">'
        f"<title>{title}</title><style>{style}</style></head>"
        f"<body><h1>{title}</h1>{''.join(sections)}</body></html>\n"
    )


def write_report(run: Path) -> Path:
    run = Path(run)
    if not run.is_dir():
        raise FileNotFoundError(f"run directory {run} does not exist")
    trained = read_summary(run) or {}
    pair = before_after.read(run, trained)  # the rows and their distances, once for the report and the card
    text = _report_html(run, trained, pair)
    with atomic_file(run / REPORT, "w") as fh:
        fh.write(text)
    if trained:  # a finished run's result gets its model card beside it, with the before and after picture
        if pair is not None:
            before_after.write_picture(run, pair)
        write_model_card(run, trained, pair)
    return run / REPORT
