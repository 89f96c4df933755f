"""A run's model card: the ``README.md`` Hub users expect beside a LoRA, an embedding or a pipeline.

Its front matter is the Hub's (``base_model``, ``library_name``, ``tags``, ``instance_prompt``); its text says what
was trained (method, adapter, steps, ranks, resolution, family), shows the before and after rows
(:mod:`xeonsd.ops.before_after`) when export.yml drew them, and how to load the result in diffusers. ``xeonsd
report`` writes it beside report.html; it is rewritten with the report, from what the run directory holds.
"""

from __future__ import annotations

import json
from pathlib import Path

from xeonsd.contracts.method_names import METHOD_FILES, PEFT_ADAPTERS, run_adapter
from xeonsd.fsutil import atomic_file
from xeonsd.ops import before_after

CARD = "README.md"


def _trigger(summary: dict, pair: before_after.BeforeAfter | None) -> str | None:
    """The words that call the concept: the learned tokens, else the after row's prompt."""
    tokens = summary.get("placeholder_tokens")
    if tokens:  # the concept's token; diffusers adds the rest of a multi-vector concept's tokens itself
        return tokens[0]
    return pair.after.prompt if pair is not None else None


def _loading(summary: dict, trigger: str | None) -> str:
    """Python that loads the result onto its base model in diffusers (the run directory as ``run``); the strings are
    JSON's, valid Python whatever quotes a prompt holds."""
    method, base = summary.get("method"), summary.get("base_model", "BASE_MODEL")
    prompt = trigger or "a photo"
    head = 'from diffusers import DiffusionPipeline\n\nrun = "."  # this directory\n'
    if method == "full":
        return head + f"pipe = DiffusionPipeline.from_pretrained(run)\nimage = pipe({json.dumps(prompt)}).images[0]\n"
    load = f"pipe = DiffusionPipeline.from_pretrained({json.dumps(str(base))})\n"
    if method == "textual_inversion":
        token = summary["placeholder_tokens"][0]
        weights = METHOD_FILES[method]["result"]
        load += f'pipe.load_textual_inversion(f"{{run}}/{weights}", token={json.dumps(token)})\n'
    elif run_adapter(summary) in PEFT_ADAPTERS:
        load = (
            "from peft import PeftModel\n\n"
            + load
            + "denoiser = pipe.transformer if hasattr(pipe, 'transformer') else pipe.unet\n"
            + "denoiser = PeftModel.from_pretrained(denoiser, run)  # adapter_config.json + adapter_model.safetensors\n"
        )
    else:
        load += "pipe.load_lora_weights(run)\n"
    return head + load + f"image = pipe({json.dumps(prompt)}).images[0]\n"


def model_card(run: Path, summary: dict, pair: before_after.BeforeAfter | None) -> str:
    """The card's Markdown, front matter first; ``pair``: the run's before and after rows (:func:`.before_after.read`),
    None where export.yml drew no before row."""
    method = summary.get("method", "?")
    adapter = run_adapter(summary) if method == "lora" else None
    trigger = _trigger(summary, pair)
    tags = ["text-to-image", "diffusers", "xeonsd", method.replace("_", "-"), *([adapter] if adapter else [])]
    front = [
        "---",
        f"base_model: {summary.get('base_model', 'unknown')}",
        "library_name: diffusers",
        "tags:",
        *(f"- {t}" for t in dict.fromkeys(tags)),
        *([f'instance_prompt: "{trigger}"'] if trigger else []),
        "---",
    ]
    what = METHOD_FILES.get(method, {}).get("what", method)
    facts = {
        "method": method + (f" ({adapter})" if adapter and adapter != "lora" else ""),
        "trigger": f"`{trigger}`" if trigger else None,
        "base model": f"`{summary.get('base_model')}`"
        + (f" ({summary['family_label']})" if "family_label" in summary else ""),
        "steps": summary.get("steps"),
        "ranks": summary.get("ranks"),
        "resolution": summary.get("resolution"),
        "result": f"`{(summary.get('result') or {}).get('path')}`",
    }
    demo = f" Its base model is {before_after.DEMO_NOTE}." if before_after.demo_base(summary) else ""
    body = [f"# {what.capitalize()}: {trigger or run.name}", "", f"Trained with xeonsd on CPUs.{demo}", ""]
    body += [f"- {k}: {v}" for k, v in facts.items() if v is not None] + [""]
    if pair is not None:
        body += ["## Before and after", "", f"![before, then after]({before_after.PICTURE})", ""]
        body += [f"Top row, before (the base model): “{pair.before.prompt}”; bottom row, after: “{pair.after.prompt}”."]
        body += ["", before_after.verdict(pair), ""]
    body += ["## Use it in diffusers", "", "```python", _loading(summary, trigger).rstrip(), "```", ""]
    return "\n".join(front + [""] + body)


def write_model_card(run: Path, summary: dict, pair: before_after.BeforeAfter | None) -> Path:
    """RUN/README.md, written whole or not at all."""
    with atomic_file(Path(run) / CARD, "w") as fh:
        fh.write(model_card(Path(run), summary, pair))
    return Path(run) / CARD
