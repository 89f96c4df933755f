"""Operating a cluster: checking a node before a job and reading a run after it.

It owns ``xeonsd doctor`` (:mod:`.doctor`: the node's stack, data, memory and one training step), ``xeonsd report``
(:mod:`.report`: report.html; :mod:`.report_cluster`: its cluster sections) and the view of the cluster over a
whole run that the report and run.json share (:mod:`.run_view`: per-node CPU use, stragglers, cost). It may import
the top-level modules, the trainer (its configuration, data checks, memory estimate and metrics files) the
cluster code (core counts, rank statistics) and the model families (:mod:`xeonsd.families`).
"""
