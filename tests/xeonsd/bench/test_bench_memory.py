"""``xeonsd bench memory``: its per-node estimate and its target lines (the runs themselves are real mpirun jobs,
measured by hand: docs/benchmarks.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from xeonsd.bench.memory import PssSampler, node_estimate, targets
from xeonsd.trainer.memory.measure import MemoryEstimate

GB = 1e9


def _row(ranks: int, mode: str, loading: float, training: float, shared: float = 0.0, first: float = 10.0) -> dict:
    return {
        "ranks": ranks,
        "share_weights": mode,
        "loading_peak": int(loading * GB),
        "training_peak": int(training * GB),
        "shared_bytes": int(shared * GB),
        "shared_held_bytes": int(shared * GB),
        "first_step_s": first,
        "estimate": {"loading": 0, "training": 0},
    }


def test_the_node_estimate_counts_shared_weights_once_per_phase():
    est = MemoryEstimate(
        weights=int(8 * GB), gradients=0, optimizer=0, activations=int(2 * GB), caches=0, runtime=int(0.5 * GB),
        loading=int(9 * GB), shared_training=int(7 * GB), shared_loading=int(8 * GB), loading_transient=int(0.25 * GB),
    )  # fmt: skip
    saved = est.as_dict()
    assert node_estimate(saved, 4, shared=False) == {"loading": 4 * est.loading, "training": 4 * est.training}
    shared = node_estimate(saved, 4, shared=True)
    assert shared["training"] == int(7 * GB) + 4 * (est.training - int(7 * GB))
    assert shared["loading"] == int(8 * GB) + 4 * int(0.75 * GB) + int(0.25 * GB)  # the transient: one rank's
    assert est.per_node(4, True) == max(shared.values())


def test_the_targets_say_met_or_not_met_with_their_figures():
    rows = [
        _row(1, "off", 3.0, 4.0),
        _row(1, "on", 3.0, 4.0, shared=2.0),
        _row(4, "off", 12.0, 16.0, first=40.0),
        _row(4, "on", 7.0, 10.0, shared=2.0, first=20.0),
    ]
    lines = targets(rows)
    assert "4 rank(s): node peak shared / private = 0.62x (10.00 / 16.00 GB); time to first step 0.50x" in lines
    # bound: (2 + 4 x (4 - 2)) x 1.1 = 11 GB >= 10 GB
    assert any(line.startswith("target: 4 shared ranks") and "10.00 GB vs 11.00 GB" in line and line.endswith(": met")
               for line in lines)  # fmt: skip
    worse = [*rows[:3], _row(4, "on", 7.0, 12.0, shared=2.0)]
    assert any(line.startswith("target: 4 shared ranks") and line.endswith("NOT met") for line in targets(worse))
    before = [*rows, _row(4, "before", 14.0, 16.0, first=50.0)]  # private and every model at once
    assert "4 rank(s): node peak shared / before = 0.62x (10.00 / 16.00 GB); time to first step 0.40x" in targets(
        before
    )
    heavy_load = [_row(1, "on", 5.0, 4.0, shared=2.0)]
    assert targets(heavy_load)[-1] == "target: loading peak <= 1.1 x training peak (1 rank, shared): 1.25x: NOT met"


def test_the_sampler_adds_up_the_ranks_pss_by_phase(tmp_path):
    """A parent with two children that look like ranks (their command line names xeonsd.cli): the sampler's peak is
    about the children's PSS summed, in loading while any rank's status file says starting, then in training."""
    status = tmp_path / "status"
    status.mkdir()
    for r in range(2):
        (status / f"rank-{r}.json").write_text('{"state": "starting"}')
    child = "import sys, time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(30)"
    parent = (
        "import subprocess, sys; "
        f"ps = [subprocess.Popen([sys.executable, '-c', {child!r}, 'xeonsd' + '.cli']) for _ in range(2)]; "
        "[p.wait() for p in ps]"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent])
    sampler = PssSampler(proc.pid, status, 0.05, ranks=2)
    sampler.start()
    both = 2 * 64 * 2**20
    try:
        deadline = time.monotonic() + 60
        while sampler.peaks["loading"] < both and time.monotonic() < deadline:
            time.sleep(0.1)
        (status / "rank-0.json").write_text('{"state": "running"}')
        time.sleep(0.5)
        assert sampler.peaks["training"] == 0  # rank 1 still loads
        (status / "rank-1.json").write_text('{"state": "running"}')
        time.sleep(1)
    finally:
        sampler.done.set()
        sampler.join()
        for pid in _children(proc.pid):
            os.kill(pid, 9)
        proc.wait()
    for phase in ("loading", "training"):
        assert both <= sampler.peaks[phase] < both + 60 * 2**20, sampler.peaks  # + the interpreters


def _children(pid: int) -> list[int]:
    from xeonsd.bench.memory import _descendants

    return _descendants(pid)


def test_a_layout_the_trainer_refuses_is_a_row_that_says_so():
    from xeonsd.bench.memory import format_rows

    refused = {"ranks": 2, "share_weights": "off", "refused": "the estimated peak memory is 15.3 GB per rank x 2"}
    rows = [_row(1, "on", 3.0, 4.0, shared=2.0), refused, _row(2, "on", 5.0, 6.0, shared=2.0)]
    assert (
        "    2     off refused by the trainer's estimate: the estimated peak memory is 15.3 GB" in format_rows(rows)[2]
    )
    assert any(line.startswith("target: 2 shared ranks") for line in targets(rows))
