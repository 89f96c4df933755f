"""xeonsd: fine-tune Stable Diffusion on a cluster of Xeon CPUs (textual inversion, LoRA, full; data-parallel over
MPI ranks) and ship the result as an OpenVINO model.

The package is one subpackage per concern; each ``__init__`` says what it owns and what it may import:

* :mod:`xeonsd.contracts`: what the package and the playbooks agree on (method names, the straggler rule, the rank
  layout result, the job's status and run files); standard library only, imported by the Ansible plugins;
* :mod:`xeonsd.jobs`: what acts on a job's files (the ranks' status writer, run.sh's attempt records, the finetune
  role's poll and stop, Slurm's accounting) and ``xeonsd jobstatus`` / ``runjson`` / ``slurmjob``; standard library
  only, run on the nodes;
* :mod:`xeonsd.families`: the model families, one folder each (what the family's pipeline is, how it is detected,
  how it trains), registered once; the specs and detection standard library only;
* :mod:`xeonsd.modelfiles`: the files a model is made of (its source, concept and LoRA files);
* :mod:`xeonsd.cluster`: the runtime of a job's ranks: the process group, rank statistics, ``hello``;
* :mod:`xeonsd.trainer`: ``xeonsd train``, in layers (its ``__init__`` lists them);
* :mod:`xeonsd.openvino`: ``xeonsd export`` / ``generate``: the IR export, int8, the export's manifest, LoRA files;
* :mod:`xeonsd.torch_engine`: ``generate --engine torch``: a family's diffusers pipeline in PyTorch with a run's
  LoRA or concept, for the families with no OpenVINO export (FLUX.1 Kontext, Qwen-Image-Edit);
* :mod:`xeonsd.serve`: ``xeonsd serve``: the OpenAI/OVMS images API over an export, LoRA adapters per request;
* :mod:`xeonsd.ops`: ``xeonsd doctor`` / ``report``: checking a node and reading a finished run;
* :mod:`xeonsd.bench`: ``xeonsd bench train`` / ``generate`` / ``layout`` / ``serve`` / ``optimizer``;
* :mod:`xeonsd.assets`: the offline tiny models and image set that the demo and the tests build.

At the top level only what more than one of them uses: :mod:`~xeonsd.cli` (the command line), :mod:`~xeonsd.flags`
(a command's options dataclass makes its flags), :mod:`~xeonsd.fsutil` (crash-safe output), :mod:`~xeonsd.console`
(a command's console: the libraries' chatter in a log file),
:mod:`~xeonsd.cpu` (what the CPU offers), :mod:`~xeonsd.flops` (FLOP counts and the matmul peak),
:mod:`~xeonsd.step_profile` (a step's time and FLOPs per class of work) and :mod:`~xeonsd.templates` (the recipe's
prompt templates).
"""

__version__ = "0.1.0"
