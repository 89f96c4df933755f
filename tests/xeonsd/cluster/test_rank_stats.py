"""The per-rank CPU utilisation and time split, and the straggler verdict, on recorded figures."""

from __future__ import annotations

import pytest

from xeonsd.cluster.rank_stats import (
    CAUSES,
    Interval,
    RankClock,
    StragglerWatch,
    node_names,
    shared_cores,
    summarize,
)


class FakeClock:
    """Wall and CPU clocks that a test moves by hand."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0


def test_utilisation_is_cpu_time_over_wall_time_times_threads_and_compute_is_the_rest() -> None:
    t = FakeClock()
    clock = RankClock(threads=4, wall=lambda: t.wall, cpu=lambda: t.cpu)
    for _ in range(2):  # two recorded steps: 0.2 s data, 3.0 s compute at 3.6 of 4 cores, 0.8 s in the all-reduce
        clock.start_step()
        with clock.phase("data"):
            t.wall += 0.2
            t.cpu += 0.2
        t.wall += 3.0
        t.cpu += 3.0 * 3.6
        with clock.phase("allreduce"):
            t.wall += 0.8
            t.cpu += 0.8 * 0.5
        clock.end_step()
    iv = clock.take()
    assert iv.steps == 2 and iv.wall_s == pytest.approx(8.0) and iv.cpu_s == pytest.approx(22.8)
    assert iv.cpu_util == pytest.approx(22.8 / (8.0 * 4))  # 71 %
    assert (iv.data_s, iv.allreduce_s, iv.compute_s) == pytest.approx((0.4, 1.6, 6.0))
    assert clock.take().steps == 0, "take() starts a new interval"
    assert Interval.from_floats(iv.as_floats()) == iv


def _iv(util: float, compute: float, allreduce: float, steps: int = 5, threads: int = 4) -> Interval:
    wall = (compute + allreduce + 0.1) * steps
    return Interval(steps, wall, util * wall * threads, threads, 0.1 * steps, allreduce * steps)


# Recorded on 4 nodes × 2 ranks: node3's ranks share their cores with a busy process.
NODES = ["node1", "node1", "node2", "node2", "node3", "node3", "node4", "node4"]
FAST = [_iv(0.96, 2.0, 1.1), _iv(0.95, 2.0, 1.1)]
SLOW = [_iv(0.55, 3.0, 0.1), _iv(0.57, 3.0, 0.1)]


def test_summary_per_node_names_the_lowest_and_the_slowest_node() -> None:
    s = summarize(FAST + FAST + SLOW + FAST, NODES)
    assert [n["node"] for n in s["nodes"]] == ["node1", "node2", "node3", "node4"]
    node3 = s["nodes"][2]
    assert node3["ranks"] == [4, 5] and node3["cpu_util"] == pytest.approx(0.56)
    assert node3["compute_s"] == pytest.approx(3.0) and node3["allreduce_s"] == pytest.approx(0.1)
    assert (s["lowest_node"], s["slowest_node"]) == ("node3", "node3")
    assert s["median_compute_s"] == pytest.approx(2.0) and s["slowest_compute_s"] == pytest.approx(3.0)
    assert s["cpu_util"] == pytest.approx((0.955 * 6 + 0.56 * 2) / 8, abs=1e-3)
    assert len(s["ranks"]) == 8 and s["ranks"][5]["node"] == "node3"


def test_a_node_slower_than_1_3x_the_median_is_a_straggler_at_once() -> None:
    watch = StragglerWatch()
    found = watch.judge(summarize(FAST + FAST + SLOW + FAST, NODES))
    assert [f["node"] for f in found] == ["node3"] and found[0]["ranks"] == [4, 5]
    assert "1.50× the median" in found[0]["why"][0] and found[0]["causes"] == list(CAUSES)
    assert CAUSES[0].startswith("threads per rank vs. physical cores")


def test_low_utilisation_is_flagged_only_after_three_intervals_in_a_row() -> None:
    low = [_iv(0.7, 2.0, 0.5), _iv(0.7, 2.0, 0.5)]
    watch = StragglerWatch(min_util=0.8, ratio=1.3, intervals=3)
    fast4 = FAST * 3
    verdicts = [
        watch.judge(summarize(seq, NODES))
        for seq in (low + fast4, low + fast4, FAST + fast4, low + fast4, low + fast4, low + fast4)
    ]
    assert [[f["node"] for f in v] for v in verdicts] == [[], [], [], [], [], ["node1"]]
    assert "70% under 80% for 3 intervals" in verdicts[-1][0]["why"][0]


def test_one_node_is_never_its_own_straggler_by_compute() -> None:
    assert StragglerWatch().judge(summarize(FAST, ["node1", "node1"])) == []


def test_node_names_map_addresses_to_inventory_names() -> None:
    env = {"XEONSD_NODE_NAMES": "10.0.0.1=node1, 10.0.0.2=node2"}
    assert node_names(env) == {"10.0.0.1": "node1", "10.0.0.2": "node2"}
    assert node_names({}) == {}


# The demo on the test cluster: 4 nodes × 4 ranks × 1 thread, every node a namespace of one 2-core machine; each
# rank gets 10-12 % of a core and every node computes as fast as the others.
DEMO_NODES = [f"node{r // 4 + 1}" for r in range(16)]
DEMO = [
    Interval(5, 10.0, util * 10.0, 1, 0.5, 2.0, cores=2)
    for util in (0.11, 0.12, 0.10, 0.11, 0.12, 0.11, 0.11, 0.12, 0.10, 0.11, 0.12, 0.11, 0.11, 0.10, 0.12, 0.11)
]


def _three_intervals(watch: StragglerWatch, seq: list[Interval], nodes: list[str]) -> list[dict]:
    return [watch.verdict(summarize(seq, nodes)) for _ in range(3)]


def test_every_node_equally_low_is_the_shared_cores_said_once_not_four_stragglers() -> None:
    verdicts = _three_intervals(StragglerWatch(shared_cores=2), DEMO, DEMO_NODES)
    assert [v["stragglers"] for v in verdicts] == [[], [], []]
    assert "layout_verdict" not in verdicts[0] and "layout_verdict" not in verdicts[1]  # after 3 intervals, as before
    v = verdicts[2]["layout_verdict"]
    assert (v["nodes"], v["ranks_per_node"], v["threads_per_rank"], v["cores"], v["shared_cores"]) == (4, 4, 1, 2, 2)
    text = v["text"]
    assert text.startswith("all 4 nodes equally low on CPU (11-12%, under 80% for 3 intervals), so no node is a ")
    assert (
        "share one machine's 2 physical cores (the test cluster): 4 nodes × 4 ranks × 1 thread = 16 threads on "
        "2 cores, at most 12% of a core each" in text
    )
    assert "holds every rank back" not in text and "slower CPU" not in text


def test_every_node_equally_low_on_its_own_cores_names_the_oversubscribed_layout() -> None:
    v = _three_intervals(StragglerWatch(), DEMO, DEMO_NODES)[-1]
    assert v["stragglers"] == []
    assert (
        "Each node runs 4 ranks × 1 thread = 4 threads on its 2 physical cores (2.0× oversubscribed). Fix: "
        in (v["layout_verdict"]["text"])
    )
    fits = [Interval(5, 10.0, 0.4 * 10.0 * 14, 14, 0.5, 2.0, cores=56) for _ in range(8)]
    text = _three_intervals(StragglerWatch(), fits, NODES)[-1]["layout_verdict"]["text"]
    assert "Each node runs 2 ranks × 14 threads = 28 threads on its 56 physical cores, which fits: another load" in text


def test_a_node_that_lags_the_median_is_still_a_straggler_when_every_node_is_low() -> None:
    lagging = DEMO[:8] + [Interval(5, 13.0, 0.11 * 13.0, 1, 0.5, 0.5, cores=2) for _ in range(4)] + DEMO[12:]
    v = _three_intervals(StragglerWatch(), lagging, DEMO_NODES)[-1]
    assert [s["node"] for s in v["stragglers"]] == ["node3"]
    assert len(v["stragglers"][0]["why"]) == 1 and "× the median" in v["stragglers"][0]["why"][0]  # not its CPU
    assert "layout_verdict" in v  # and the cluster-wide low CPU, once


def test_one_low_node_among_busy_ones_is_still_a_straggler_and_no_layout_verdict() -> None:
    low = [_iv(0.5, 2.0, 0.5), _iv(0.5, 2.0, 0.5)]
    v = _three_intervals(StragglerWatch(), low + FAST * 3, NODES)[-1]
    assert [s["node"] for s in v["stragglers"]] == ["node1"] and "layout_verdict" not in v


def test_the_shared_cores_come_from_the_environment() -> None:
    assert shared_cores({"XEONSD_SHARED_CORES": "2"}) == 2
    assert shared_cores({"XEONSD_SHARED_CORES": "0"}) == 0 and shared_cores({}) == 0
    assert Interval.from_floats(DEMO[0].as_floats()) == DEMO[0]
