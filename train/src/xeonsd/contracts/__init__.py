"""What the package and the playbooks agree on, defined once: names, rules and the run directory's JSON files.

The Ansible plugins import these modules on the controller (``plugins/filter``) and :mod:`xeonsd.jobs`, which acts on
these files, imports them on the nodes, so they import nothing but the standard library and each other. They hold
schemas, names and the rules that read and check them (and the one crash-safe way to write a file); what acts on a
job (keeps its records, waits for it, judges how it ended, signals it) is :mod:`xeonsd.jobs`:

* :mod:`.method_names`: the training methods and what each leaves in the run directory;
* :mod:`.straggler_rule`: when a node is a straggler, and its likely causes;
* :mod:`.layout_result`: a node's measured rank layouts and the result ``ranks_per_node: auto`` reads;
* :mod:`.job_status`: the ranks' status files, ``attempt.json`` and ``exit.json``, and the exit codes;
* :mod:`.run_files`: ``train_summary.json`` and ``run.json``; :mod:`.slurm_job`: ``slurm.json``;
* :mod:`.serve_plan`: what ``serve.yml`` serves (the run, its export, the adapters by name) and its ``xeonsd serve``
  command line; :mod:`.blend_syntax`: a LoRA blend as ``serve_blends``, ``--blend`` and a request write it.
"""
