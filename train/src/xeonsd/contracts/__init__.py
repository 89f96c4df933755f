"""What the package and the playbooks agree on, defined once: names, rules and the run directory's JSON files.

The Ansible plugins import these modules on the controller (``plugins/filter``) and the finetune role runs their
command line on the nodes, so they import nothing but the standard library and each other:

* :mod:`.method_names`: the training methods and what each leaves in the run directory;
* :mod:`.straggler_rule`: when a node is a straggler, and its likely causes;
* :mod:`.layout_result`: a node's measured rank layouts and the result ``ranks_per_node: auto`` reads;
* :mod:`.job_status` (with its command line :mod:`.job_status_cli`): the ranks' status files, ``attempt.json`` and
  ``exit.json``; :mod:`.job_watch` and :mod:`.job_progress`: what the finetune role's poll reads of them;
* :mod:`.run_files`: ``train_summary.json`` and ``run.json``; :mod:`.slurm_job`: ``slurm.json``;
* :mod:`.serve_plan`: what ``serve.yml`` serves (the run, its export, the adapters by name) and its ``xeonsd serve``
  command line.
"""
