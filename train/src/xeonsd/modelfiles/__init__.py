"""The files a model is made of, read and written the same way by the trainer and the OpenVINO side.

* :mod:`.families`: which model family a pipeline is (SD 1.x/2.x, SDXL), from its config files before any weight
  loads, and what each family's pipeline looks like;
* :mod:`.modelsource`: where a model comes from (a directory or a Hub id) and its fingerprint;
* :mod:`.concept_file`: a learned concept's file (one vector set, or SDXL's two);
* :mod:`.lora_layout`: LoRA files in the diffusers and the kohya layout, and the converter between them.

It may import the top-level modules only.
"""
