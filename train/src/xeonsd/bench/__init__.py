"""The benchmarks (``xeonsd bench train`` and ``xeonsd bench generate``): variants of one job measured in one run,
each figure printed beside its baseline.

``bench train`` is :mod:`.train`. ``bench generate`` is :mod:`.generate` (the command line and the variants in
order), :mod:`.generate_pipelines` (the model, the cached exports, each pipeline loaded and timed) and
:mod:`.generate_report` (FLOPs per image, matmul peaks, the table and its targets). They may import every other
part of the package; nothing imports them but the CLI.
"""
