"""What differs between the families on the OpenVINO side, asked of the family's spec
(:class:`xeonsd.families.FamilySpec`, handed in by the caller: detected from a model's files, or read from an
export's manifest with :func:`xeonsd.families.of_manifest`):

* the classes: diffusers' pipeline (``spec.pipeline_class``) before the export, optimum-intel's
  (``spec.ov_pipeline_class``) for the export and its engine;
* the text side, as (text encoder, tokenizer) pairs: a concept goes into every pair (SDXL: ``clip_l`` into
  ``text_encoder``, ``clip_g`` into ``text_encoder_2``, see :mod:`xeonsd.modelfiles.concept_file`), the OpenVINO
  tokenizer model is written for every tokenizer;
* the parts a LoRA adapts (:func:`lora_parts`): the denoiser and the CLIP text encoders (``spec.clip_encoders``),
  never T5;
* a LoRA's text-encoder part for GenAI where a family has two CLIP text encoders (SDXL): OpenVINO GenAI 2026.4.1
  applies an adapter's ``lora_te_`` tensors to *both* SDXL text encoders alike and ignores kohya's
  ``lora_te1_``/``lora_te2_`` ("Unused LoRA tensor", the image does not change; measured on tiny-xl), so one adapter
  cannot carry the two encoders' different weights. :func:`fuse_into_ir` adds them to the weights of a copy of each
  text encoder's graph instead (``W += alpha * (file alpha / rank) * up @ down``, the kohya scale GenAI applies),
  and GenAI gets the UNet part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xeonsd.families import FamilySpec


def lora_parts(pipe: Any, family: FamilySpec) -> dict[str, Any]:
    """{component: model} of what a LoRA of ``family`` adapts in a diffusers pipeline, as
    :func:`xeonsd.modelfiles.lora_layout.torch_weight_shapes` takes them (``unet`` is None for a transformer)."""
    parts = {"unet": None, "text_encoder": None, "text_encoder_2": None}
    parts[family.denoiser] = getattr(pipe, family.denoiser)
    for encoder in family.clip_encoders:
        parts[encoder] = getattr(pipe, encoder)
    return parts


def ov_pipeline_class(family: FamilySpec) -> Any:
    """optimum-intel's pipeline class of ``family``."""
    import optimum.intel

    return getattr(optimum.intel, family.ov_pipeline_class)


def max_sequence_length(pipe: Any, family: FamilySpec) -> int | None:
    """FLUX.1/SD3: T5's prompt length of a loaded pipeline (:meth:`FamilySpec.prompt_length` with its T5
    tokenizer's limit). A static export fixes it (optimum-intel reshapes FLUX's T5 to it), and every engine passes it
    as ``max_sequence_length``; None for the CLIP-only families."""
    if family.max_sequence_length is None:
        return None
    return family.prompt_length(getattr(getattr(pipe, family.tokenizers[-1]), "model_max_length", None))


def load_torch_pipeline(src: str, family: FamilySpec) -> Any:
    """The diffusers pipeline of ``family`` at ``src`` (fp32, no safety checker)."""
    import diffusers

    return getattr(diffusers, family.pipeline_class).from_pretrained(src, **dict(family.pipeline_kwargs))


def add_concepts_to_torch(pipe: Any, family: FamilySpec, concepts: dict[str, Any]) -> list[str]:
    """Each text encoder's concept (from :func:`xeonsd.modelfiles.concept_file.load_concepts`) into it and its tokenizer."""
    from xeonsd.modelfiles.concept_file import add_to_torch

    for encoder, tokenizer in family.text_side:
        add_to_torch(getattr(pipe, tokenizer), getattr(pipe, encoder), concepts[encoder])
    return concepts["text_encoder"].tokens


def lora_components(pipe: Any, family: FamilySpec) -> list[str]:
    """The parts of ``pipe`` that hold adapter layers (the denoiser, CLIP text encoders), for ``fuse_lora``."""
    parts = [family.denoiser, *family.clip_encoders]
    return [p for p in parts if getattr(getattr(pipe, p), "peft_config", None)]


def unload_fused_lora(pipe: Any, family: FamilySpec) -> None:
    """Remove the adapter layers after ``fuse_lora``, keeping the fused weights. FLUX.1's
    ``FluxPipeline.unload_lora_weights`` also undoes the fusion (diffusers 0.39: its images after fuse + unload are
    the base model's again, measured on tiny-flux), so the flow families unload each part on its own."""
    if family.objective != "flow":
        pipe.unload_lora_weights()
        return
    from diffusers.utils.peft_utils import recurse_remove_peft_layers

    getattr(pipe, family.denoiser).unload_lora()
    for encoder in family.clip_encoders:
        te = getattr(pipe, encoder)
        recurse_remove_peft_layers(te)
        if hasattr(te, "peft_config"):
            del te.peft_config
            te._hf_peft_config_loaded = None


def fresh_text_encoders(pipe: Any, family: FamilySpec) -> None:
    """Replace each text encoder by a fresh model holding its weights. transformers 5 saves a text encoder that once
    held peft layers under other keys ("text_base_model.model.…"), which load as missing (random) weights."""
    for encoder in family.clip_encoders:  # T5 never holds peft layers (and is 4.7 B parameters in FLUX.1)
        te = getattr(pipe, encoder)
        clean = type(te)(te.config)
        clean.load_state_dict(te.state_dict())
        pipe.register_modules(**{encoder: clean.eval()})


def fuse_into_ir(model: Any, modules: list[Any], alpha: float) -> int:
    """Add LoRA ``modules`` (:class:`xeonsd.openvino.lora_files.LoraModule`, named ``<prefix><module with _>``)
    to the matching weights ``self.<module>.weight`` of an uncompiled OpenVINO text encoder, in place; returns the
    number of weights changed. Only float weights can take the sum: an 8-bit weight is refused."""
    import numpy as np
    import openvino as ov
    from openvino import opset13

    from xeonsd.openvino.lora_files import LoraFormatError

    by_module = {}
    for mod in modules:
        by_module[mod.name.split("_", 2)[2]] = mod  # lora_te_text_model_… / lora_te2_text_model_… -> text_model_…
    changed = 0
    for op in model.get_ops():
        name = op.get_friendly_name()
        if op.get_type_name() != "Constant" or not name.startswith("self.") or not name.endswith(".weight"):
            continue
        mod = by_module.get(name[len("self.") : -len(".weight")].replace(".", "_"))
        if mod is None:
            continue
        if op.get_element_type() not in (ov.Type.f32, ov.Type.f16):
            raise LoraFormatError(
                f"{mod.label}: the export's text encoder weight is {op.get_element_type().get_type_name()}; a LoRA "
                "on an 8-bit text encoder cannot be applied at generation time: fuse it into an export "
                "(xeonsd export SRC OUT --lora FILE)"
            )
        weight = op.get_data().astype(np.float32)
        scale = alpha * (mod.alpha if mod.alpha is not None else mod.rank) / mod.rank
        summed = weight + scale * (mod.up.astype(np.float32) @ mod.down.astype(np.float32))
        new = opset13.constant(summed.astype(weight.dtype if op.get_element_type() == ov.Type.f32 else np.float16))
        new.set_friendly_name(name)
        op.output(0).replace(new.output(0))
        changed += 1
    return changed


def split_free_matmul_inputs(model: Any) -> int:
    """Give every MatMul whose input is one output of a multi-output node (FLUX.1's attention output projections
    ``to_out.0`` and ``to_add_out`` read a VariadicSplit of the joint attention) an identity Reshape in between, in
    place; returns how many. OpenVINO GenAI 2026.4.1's LoRA pass fails on such a MatMul ("Default output not
    supported", measured on tiny-flux); the Reshape is an identity the compiler removes."""
    import numpy as np
    from openvino import opset13

    changed = 0
    for op in model.get_ops():
        if op.get_type_name() != "MatMul" or op.input_value(0).get_node().get_output_size() < 2:
            continue
        keep = opset13.constant(np.array([0] * op.input_value(0).get_partial_shape().rank.get_length(), np.int64))
        identity = opset13.reshape(op.input_value(0), keep, special_zero=True)
        identity.set_friendly_name(op.get_friendly_name() + "/input")
        op.input(0).replace_source_output(identity.output(0))
        changed += 1
    return changed


def reshape_text_length(pipe: Any, family: FamilySpec, length: int | None) -> int:
    """Give every static Qwen text encoder of a reshaped pipeline the prompt length the engines pass
    (``max_sequence_length``), in place; returns how many were reshaped. optimum-intel 2.2's ``reshape`` fixes a
    text encoder's sequence axis to its tokenizer's ``model_max_length`` (Qwen's: 32768, where FLUX.2 [klein]'s
    pipeline pads its prompt to 512: "Can't set the input tensor", measured on tiny-flux2); a dynamic one
    (Z-Image's, Qwen-Image's) stays dynamic. CLIP and T5 keep optimum's length."""
    changed = 0
    for i, encoder in enumerate(family.text_encoders):
        if length is None or family.text_encoder_class(i).startswith(("CLIP", "T5")):
            continue
        part = getattr(pipe, encoder)
        shapes = {}
        for port in part.model.inputs:
            shape = port.get_partial_shape()
            if shape.rank.get_length() == 2 and shape[1].is_static and shape[1].get_length() != length:
                shape[1] = length
                shapes[port] = shape
        if shapes:
            part.model.reshape(shapes)
            changed += 1
    if changed:
        pipe.clear_requests()
    return changed
