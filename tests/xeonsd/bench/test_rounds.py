"""The statistics of interleaved rounds, on recorded timings (no time is measured or asserted here)."""

from __future__ import annotations

import pytest

from xeonsd.bench import rounds as rnd

# Three rounds of a run on a machine that slowed down by 2x between round 1 and round 3: in every round B takes
# 1.5x and C 0.8x as long as A, while A itself drifts 4.0 -> 6.0 -> 8.0 s.
RECORDED = {"A": [4.0, 6.0, 8.0], "B": [6.0, 9.0, 12.0], "C": [3.2, 4.8, 6.4]}


def test_the_schedule_interleaves_the_variants_round_by_round() -> None:
    order = rnd.schedule(["A", "B", "C"], 2)
    assert [name for _, name in order] == ["A", "B", "C", "A", "B", "C"]
    assert [r for r, _ in order] == [0, 0, 0, 1, 1, 1]
    assert [name for _, name in rnd.schedule(["A"], 3)] == ["A", "A", "A"]
    with pytest.raises(ValueError):
        rnd.schedule(["A", "B"], 0)


def test_ratios_are_taken_within_each_round_so_drift_cancels() -> None:
    stats = rnd.summarize(RECORDED, baseline="A")
    assert stats["B"]["ratio_rounds"] == pytest.approx([1.5, 1.5, 1.5])
    assert stats["C"]["ratio_rounds"] == pytest.approx([0.8, 0.8, 0.8])
    assert stats["B"]["ratio"]["median"] == pytest.approx(1.5)
    assert stats["B"]["ratio"]["min"] == pytest.approx(stats["B"]["ratio"]["max"])  # no spread in the ratio
    assert stats["A"]["ratio_rounds"] == [1.0, 1.0, 1.0]
    # The seconds do spread: 2x between the rounds.
    assert stats["A"]["seconds"] == {"median": 6.0, "min": 4.0, "max": 8.0, "q1": 5.0, "q3": 7.0, "n": 3}
    assert stats["B"]["rounds"] == [6.0, 9.0, 12.0]
    # A speed-up (baseline / variant), as bench generate's "vs (a)" column reads.
    inverted = rnd.summarize(RECORDED, baseline="A", invert=True)
    assert inverted["C"]["ratio"]["median"] == pytest.approx(1.25)


def test_the_ratio_median_and_spread_come_from_the_per_round_ratios() -> None:
    times = {"A": [10.0, 5.0, 10.0, 10.0], "B": [12.0, 10.0, 11.0, 13.0]}
    stats = rnd.summarize(times, baseline="A")
    assert stats["B"]["ratio_rounds"] == pytest.approx([1.2, 2.0, 1.1, 1.3])
    s = stats["B"]["ratio"]
    assert s["median"] == pytest.approx(1.25) and s["min"] == pytest.approx(1.1) and s["max"] == pytest.approx(2.0)
    assert s["q1"] == pytest.approx(1.175) and s["q3"] == pytest.approx(1.475) and s["n"] == 4
    assert stats["B"]["seconds"]["median"] == pytest.approx(11.5)
    assert rnd.range_text(s) == "1.10-2.00"
    one = rnd.spread([3.0])
    assert one["median"] == one["q1"] == one["q3"] == one["min"] == one["max"] == 3.0
    with pytest.raises(ValueError):
        rnd.per_round_ratios([1.0, 2.0], [1.0])


def _probes(fp32: list[float], bf16: list[float]) -> list[dict]:
    return [{"dtype": "fp32", "peak": f} for f in fp32] + [{"dtype": "bf16", "peak": b} for b in bf16]


def test_probes_within_15_percent_make_a_steady_verdict() -> None:
    st = rnd.stability(_probes([1.0, 1.05], [2.0, 2.1]), _probes([1.1, 1.0], [2.2, 2.05]))
    assert not st["unstable"] and st["difference"] == pytest.approx(0.1)
    assert st["by_dtype"]["bf16"]["before"] == [2.0, 2.1] and st["by_dtype"]["bf16"]["after"] == [2.2, 2.05]
    assert st["by_dtype"]["fp32"]["peak"]["median"] == pytest.approx(1.025)
    lines = rnd.verdict_lines(st)
    assert lines == ["matmul peak probes before and after the variants differ by up to 10% (<= 15%): machine steady"]
    assert rnd.UNSTABLE not in lines[-1]


def test_probes_more_than_15_percent_apart_end_the_output_with_the_unstable_line() -> None:
    # FACTS.md: 1.12, 2.19 and 0.86 TFLOP/s within 20 minutes. Here only bf16 moved, and only after the variants.
    st = rnd.stability(_probes([1.0, 1.0], [2.19, 2.1]), _probes([1.02, 1.0], [1.12, 0.86]))
    assert st["unstable"] and st["difference"] == pytest.approx(2.19 / 0.86 - 1)
    assert st["by_dtype"]["fp32"]["difference"] == pytest.approx(0.02)
    lines = rnd.verdict_lines(st)
    assert lines[-1] == "machine unstable: read the ratios, not the seconds"
    assert lines[0] == "matmul peak probes before and after the variants differ by up to 155% (> 15%)"
    # Just over the line is unstable, just under is not.
    assert rnd.stability(_probes([1.0], []), _probes([1.151], []))["unstable"]
    assert not rnd.stability(_probes([1.0], []), _probes([1.149], []))["unstable"]
