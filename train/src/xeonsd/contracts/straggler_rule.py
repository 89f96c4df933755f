"""When a node is a straggler, and its likely causes: defined here once.

The trainer's straggler watch (:mod:`xeonsd.cluster.rank_stats`, ``--straggler_ratio``'s default) and doctor.yml's
comparison of the nodes' trial steps (``plugins/filter/xeonsd_doctor.py``, which loads this file on the controller)
use the same ratio and name the same causes in the same order; the inventory's ``finetune_straggler_ratio`` and
``doctor_straggler_ratio`` are empty unless set, and then mean this ratio. Standard library only.
"""

from __future__ import annotations

# A node whose compute time per step (the trainer) or one-step trial (doctor) is above this multiple of the median
# node's holds every rank back at each all-reduce.
STRAGGLER_RATIO = 1.3

# The likely causes of a straggler, most likely first (the play, the report and doctor print them in this order).
CAUSES = (
    "threads per rank vs. physical cores (OMP_NUM_THREADS × ranks per node above the node's cores, or ranks "
    "sharing cores)",
    "another process on the node competing for its cores",
    "memory pressure or swap on the node",
    "a slower CPU than the other nodes (a cluster that mixes generations)",
)
