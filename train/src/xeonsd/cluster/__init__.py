"""What the ranks of one MPI job share, and what the job tells the playbooks.

It owns the ranks and the process group with their CPU placement (:mod:`.distributed`), each rank's CPU use and
the straggler watch (:mod:`.rank_stats`), the JSON status files whose schema the finetune role reads
(:mod:`.job_status`, their command line :mod:`.job_status_cli`), what the role's poll answers from them
(:mod:`.job_watch`, with the progress line in :mod:`.job_progress`), the schemas of ``train_summary.json`` and
``run.json`` (:mod:`.run_files`), a Slurm job's accounting (``slurm.json``, :mod:`.slurm_job`) and ``xeonsd hello``
(:mod:`.hello`). It may import the top-level modules only: the trainer uses it, never the other way round.
"""
