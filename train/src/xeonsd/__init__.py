"""xeonsd: fine-tune Stable Diffusion on a cluster of Xeon CPUs (textual inversion, LoRA, full; data-parallel over
MPI ranks) and ship the result as an OpenVINO model.

The package is one subpackage per concern; each ``__init__`` says what it owns and what it may import:

* :mod:`xeonsd.trainer`: ``xeonsd train``: configuration, data, prompts, models, the loop and the methods;
* :mod:`xeonsd.cluster`: what a job's ranks share: the process group, rank statistics, job status, ``hello``;
* :mod:`xeonsd.openvino`: ``xeonsd export`` / ``generate``: the IR export, int8, the export's manifest, LoRA files;
* :mod:`xeonsd.ops`: ``xeonsd doctor`` / ``report``: checking a node and reading a finished run;
* :mod:`xeonsd.bench`: ``xeonsd bench train`` / ``generate``.

At the top level only what more than one of them uses: :mod:`~xeonsd.cli` (the command line), :mod:`~xeonsd.fsutil`
(crash-safe output), :mod:`~xeonsd.console` (a command's console: the libraries' chatter in a log file),
:mod:`~xeonsd.cpu` (what the CPU offers), :mod:`~xeonsd.modelsource` (where a model comes from and its
fingerprint), :mod:`~xeonsd.families` (SD 1.x/2.x or SDXL, told from the pipeline's config files),
:mod:`~xeonsd.concept_file` (a learned concept's file, read by the trainer and the OpenVINO
side), :mod:`~xeonsd.flops` (FLOP counts and the matmul peak) and :mod:`~xeonsd.assets` (the offline tiny models and
image set that the demo and the tests build); and the two rules that the playbooks' filter plugins load from this
tree on the controller, so they import nothing but the standard library: :mod:`~xeonsd.method_names` (the methods
and what each leaves in the run directory), :mod:`~xeonsd.straggler_rule` (the straggler ratio and its causes) and
:mod:`~xeonsd.layout_result` (a node's rank layouts and the tuning result ``ranks_per_node: auto`` reads).
Also at the top: :mod:`~xeonsd.lora_layout` (LoRA files in the diffusers and the kohya layout and the converter
between them: the trainer writes either, the OpenVINO side reads both).
"""

__version__ = "0.1.0"
