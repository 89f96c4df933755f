"""The runtime of one MPI job's ranks.

It owns who each rank is (:mod:`.launch`, with Slurm's task layout in :mod:`.slurm_tasks`), the process group, its
collectives and a lost peer (:mod:`.distributed`), each rank's share of the cores (:mod:`.placement`), each rank's
CPU use and the straggler watch (:mod:`.rank_stats`), its memory as the kernel shares it (:mod:`.memory`) and ``xeonsd hello`` (:mod:`.hello`). What the job tells the
playbooks (status files, run files) is :mod:`xeonsd.contracts`. It may import the top-level modules and
:mod:`xeonsd.contracts` only: the trainer uses it, never the other way round.
"""
