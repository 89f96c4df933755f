"""The PyTorch engine: a model family's own diffusers pipeline, for the families optimum-intel has no OpenVINO export
for (``FamilySpec.ov_pipeline_class`` empty: FLUX.1 Kontext, Qwen-Image-Edit-2511), and for any other when asked.

:class:`TorchEngine` loads ``spec.pipeline_class`` from a pipeline directory (a base model, or a full fine-tune's
output) with the family's ``pipeline_kwargs`` and processor (Qwen-Image-Edit's, :mod:`xeonsd.families.
qwenimage_edit.processor`), adds a run's LoRA (``load_lora_weights``) or textual-inversion concept, and makes the
images of one call at a time, in bf16 where the CPU has native bf16 (AMX or AVX512-BF16) and fp32 elsewhere
(:func:`torch_dtype`). It has the OpenVINO engines' interface (:class:`xeonsd.openvino.engines.Engine`: ``open``,
``run(call)``, ``close``, ``load_s``), so ``xeonsd generate`` (:mod:`xeonsd.openvino.generate`) writes its images
and ``timings.json`` as for them, and a server can hold one open the same way.
"""

from xeonsd.torch_engine.engine import TorchEngine, call_extras, torch_dtype

__all__ = ["TorchEngine", "call_extras", "torch_dtype"]
