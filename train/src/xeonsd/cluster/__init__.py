"""The runtime of one MPI job's ranks.

It owns the ranks and the process group with their CPU placement (:mod:`.distributed`, with Slurm's task layout in
:mod:`.slurm_tasks`), each rank's CPU use and the straggler watch (:mod:`.rank_stats`) and ``xeonsd hello``
(:mod:`.hello`). What the job tells the playbooks (status files, run files) is :mod:`xeonsd.contracts`. It may
import the top-level modules and :mod:`xeonsd.contracts` only: the trainer uses it, never the other way round.
"""
