"""What acts on a training job's files, whose schemas are :mod:`xeonsd.contracts`': the writers, the readers that
judge, and the commands run.sh and the finetune role run on the nodes.

Like the contracts, these modules import nothing but the standard library, :mod:`xeonsd.contracts` and each other:
the commands run on every node without loading torch, and the trainer's ranks use the status writer.

* :mod:`.status_file`: a rank's status file, as the trainer keeps it;
* :mod:`.attempts`: run.sh's attempt records (``attempt.json``, ``exit.json``) and the clean stop of a running job;
* :mod:`.watch` (with :mod:`.progress`): the finetune role's poll: the progress line, who ended a failed job, how a
  stopped one stopped;
* :mod:`.slurm`: a Slurm job's accounting (``sacct``), into ``slurm.json``;
* :mod:`.cli`: ``xeonsd jobstatus``, ``xeonsd runjson`` and ``xeonsd slurmjob``.
"""
