"""The OpenVINO side (``xeonsd export`` and ``xeonsd generate``).

It owns the export to static-shape IR through optimum-intel (:mod:`.export`), hybrid int8 (:mod:`.quantize`), the
export directory's manifest and checks (:mod:`.manifest`), the GenAI tokenizer model (:mod:`.tokenizer`),
generation through optimum-intel or OpenVINO GenAI (:mod:`.generate`) and LoRA files in the layout GenAI applies
(:mod:`.lora_files`). It may import the top-level modules and, from the trainer, only the prompt templates that
calibrate int8 (:mod:`xeonsd.trainer.prompts`); nothing here loads the trainer's models or loop.
"""
