"""The training methods by name, and what each leaves in the run directory: defined here once.

The trainer (``--method``'s choices, each method's result file), the benchmark, the report, run.json
(:mod:`xeonsd.contracts.run_files`) and the playbooks read this: the filter plugin ``plugins/filter/xeonsd_train.py``
loads this file on the controller (the finetune role's
``finetune_method_info``, the train argv's groups, and the openvino_export role's generate flags), so it imports
nothing but the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping

METHODS = ("textual_inversion", "lora", "full")
# --method lora's adapter types (--adapter; xeonsd.trainer.methods.adapters), the first the default; those saved in
# peft's layout (diffusers' loaders do not read them), and that layout's files, the first the result.
ADAPTERS = ("lora", "lokr", "loha", "dora")
PEFT_ADAPTERS = ("lokr", "loha")
PEFT_FILES = ("adapter_model.safetensors", "adapter_config.json")
# --save_format comfyui: the adapter in the layout ComfyUI loads, written beside the result (any adapter type).
COMFYUI_FILE = "comfyui_lora.safetensors"

# What each method saves (the first output is its result, train_summary.json's ``result.path``), how people call
# it, whether it is a whole pipeline (which stays on the primary and is exported itself: no base-model export), and
# the `xeonsd generate` flag that loads it onto the base model's export (None: nothing to load), and the packages it
# imports beyond those every method needs (what `xeonsd doctor` checks on a node).
METHOD_FILES: dict[str, dict] = {
    "textual_inversion": {
        "result": "learned_embeds.safetensors",
        "what": "learned embedding",
        "pipeline": False,
        "generate_flag": "--embeds",
        "needs": (),
    },
    "lora": {
        "result": "pytorch_lora_weights.safetensors",
        "what": "LoRA adapter",
        "pipeline": False,
        "generate_flag": "--lora",
        "needs": ("peft",),
    },
    "full": {
        "result": "model_index.json",
        "what": "fine-tuned pipeline",
        "pipeline": True,
        "generate_flag": None,
        "needs": (),
    },
}


def result_file(method: str) -> str:
    return METHOD_FILES[method]["result"]


# Why --with_prior_preservation is refused with textual inversion (the config's check and the prior's say it alike).
PRIOR_NEEDS_WEIGHTS = (
    "--with_prior_preservation works with --method lora or full: textual inversion trains only the concept's "
    "new token vectors and leaves every weight of the model as it was, so the class keeps its prior anyway"
)


def run_adapter(summary: Mapping) -> str:
    """A run's adapter type from its train_summary.json: a LoRA run's ``adapter`` (one from before --adapter: plain
    LoRA), and ``lora`` for the other methods, which have no adapter of another type to fuse or refuse."""
    return summary.get("adapter", ADAPTERS[0]) if summary.get("method") == "lora" else ADAPTERS[0]
