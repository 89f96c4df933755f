"""The benchmarks (``xeonsd bench train`` and ``xeonsd bench generate``): variants of one job measured in one run,
each figure printed beside its baseline. They may import every other part of the package; nothing imports them
but the CLI.
"""
