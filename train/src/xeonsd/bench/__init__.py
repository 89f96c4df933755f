"""The benchmarks (``xeonsd bench train``, ``xeonsd bench generate``, ``xeonsd bench layout``): variants of one job
measured in one run, each figure printed beside its baseline.

``bench layout`` is :mod:`.layout`: every ranks-per-node × threads-per-rank layout of a node with the job's
arguments, the result that ``ranks_per_node: auto`` reads (doctor.yml -e tune_layout=true runs it).

``bench serve`` is :mod:`.serve`: ``xeonsd serve`` under 1…N concurrent clients against ``xeonsd generate``'s
time per image, for each ``--workers`` count (what ``--workers auto`` reads), and the cost of an adapter switch (the
closed loop itself: :mod:`.closed_loop`). ``bench serve --soak`` is :mod:`.soak`: twice the measured capacity for
minutes through a local HAProxy (or a given front) while a server is killed and an adapter rolled out; its load,
accounting and report: :mod:`.soak_report`.

``bench train`` is :mod:`.train` (its variants: :mod:`.train_variants`, run by :mod:`.train_runs`; its ``--profile``
splits a step per class of work: :mod:`xeonsd.step_profile`; the table: :mod:`.train_report`; the targets it prints:
:mod:`.targets`); ``bench optimizer`` (:mod:`.optimizer`) times one AdamW update, loop against fused;
``bench attention`` (:mod:`.attention`) one attention layer's forward and backward, torch's SDPA against the
trainer's folded queries (``--attention fold``).
``bench generate`` is :mod:`.generate` (the command line and the variants in order), :mod:`.generate_pipelines` (the model, the cached exports, each pipeline loaded and timed) and
:mod:`.generate_report` (FLOPs per image, the table and its targets). They may import every other
part of the package; nothing imports them but the CLI.
"""
