"""``xeonsd.bench.peak_rss.PeakRss``: the peak of this process's resident memory while a block runs, which ``xeonsd
bench generate`` reports per variant (the variants load and close in its own process)."""

from __future__ import annotations

import time

import numpy as np

from xeonsd.bench.peak_rss import PeakRss, resident_bytes


def test_the_peak_holds_memory_that_was_freed_before_the_block_ended() -> None:
    """256 MB touched and freed inside the block: the peak counts it, though the resident memory at the end is back
    near where it started; a block that allocates nothing peaks near its start."""
    size = 256 * 2**20
    with PeakRss(interval_s=0.01) as idle:
        pass
    before = resident_bytes()
    with PeakRss(interval_s=0.01) as busy:
        block = np.ones(size, dtype=np.uint8)  # every page written: resident
        time.sleep(0.1)  # a few reads of the sampler while it is held
        del block
    after = resident_bytes()
    assert before is not None and after is not None and idle.bytes is not None and busy.bytes is not None
    assert busy.bytes - before > 0.9 * size, (before, busy.bytes)
    assert after - before < 0.5 * size, (before, after)  # freed: the peak is the only trace of it
    assert abs(idle.bytes - before) < 0.25 * size
