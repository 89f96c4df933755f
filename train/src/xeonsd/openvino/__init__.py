"""The OpenVINO side (``xeonsd export``, ``xeonsd generate`` and the pipelines ``xeonsd serve`` compiles).

It owns the export to static-shape IR through optimum-intel (:mod:`.export`), hybrid int8 (:mod:`.quantize`), the
export directory's manifest and checks (:mod:`.manifest`), the GenAI tokenizer model (:mod:`.tokenizer`),
generation (:mod:`.generate`: the request, its calls and the output; :mod:`.engines`: the optimum-intel and
OpenVINO GenAI pipelines), an export with a learned concept added that GenAI loads as the export (:mod:`.overlay`),
LoRA files in the layout GenAI applies (:mod:`.lora_files`, through the top-level converter
:mod:`xeonsd.modelfiles.lora_layout`) and what differs between SD 1.x/2.x and SDXL (:mod:`.pipelines`: the classes,
the text encoders, an SDXL adapter's text-encoder part). It may import the top-level modules, the model families
(:mod:`xeonsd.families`) and, from the trainer, only the prompt templates that calibrate int8
(:mod:`xeonsd.trainer.prompt_tables`); nothing here loads the trainer's models or loop. ``generate`` hands a
diffusers pipeline directory to the PyTorch engine (:mod:`xeonsd.torch_engine`), which has the OpenVINO engines'
interface.
"""
