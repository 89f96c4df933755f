"""The files a model is made of, read and written the same way by the trainer and the OpenVINO side.

* :mod:`.modelsource`: where a model comes from (a directory or a Hub id) and its fingerprint;
* :mod:`.concept_file`: a learned concept's file (one vector set, or SDXL's two);
* :mod:`.lora_layout`: LoRA files in the diffusers and the kohya layout, and the converter between them.

It may import the top-level modules and :mod:`xeonsd.families` (a family's LoRA and concept layouts).
"""
