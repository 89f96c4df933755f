"""The per-rank CPU utilisation and time split, and the straggler verdict, on recorded figures."""

from __future__ import annotations

import pytest

from xeonsd.cluster.rank_stats import CAUSES, Interval, RankClock, StragglerWatch, node_names, summarize


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
