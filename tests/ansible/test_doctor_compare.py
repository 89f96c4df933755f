"""doctor.yml's comparison of the nodes (the doctor role's filter plugin) on recorded `xeonsd doctor --json` output."""

from __future__ import annotations

from repo_code import ansible_code

xeonsd_doctor = ansible_code("xeonsd_doctor")

SPR = {"cpu_model": "Intel(R) Xeon(R) Platinum 8480+", "cores": 56, "logical_cpus": 112, "amx": True}
ICX = {"cpu_model": "Intel(R) Xeon(R) Platinum 8380", "cores": 40, "logical_cpus": 80, "amx": False}


def _report(seconds: float | None, node: dict) -> dict:
    trial = {"name": "train 1 step", "status": "PASS" if seconds else "FAIL", "detail": "…", "seconds": seconds}
    return {
        "host": "x",
        "ok": True,
        "checks": [{"name": "packages", "status": "PASS", "detail": "…"}, trial],
        "node": node,
    }


def test_a_node_whose_trial_step_is_over_1_3x_the_median_is_a_straggler_and_a_mixed_cluster_is_named() -> None:
    reports = {
        "node1": _report(5.6, SPR),
        "node2": _report(5.4, SPR),
        "node3": _report(9.1, ICX),
        "node4": _report(5.7, SPR),
    }
    rows = xeonsd_doctor.compare_rows(reports, 1.3)
    straggler = {h: r[1] for h, r in rows.items()}
    assert [h for h, r in straggler.items() if r["status"] == "WARN"] == ["node3"]
    assert straggler["node3"]["detail"].startswith("trial step 9.10 s = 1.61× the median 5.65 s (over 1.3×)")
    assert straggler["node1"] == {
        "node": "node1",
        "check": "straggler",
        "status": "PASS",
        "detail": "trial step 5.60 s = 0.99× the median 5.65 s",
    }
    cpu = {h: r[0] for h, r in rows.items()}
    assert all(r["check"] == "cpu" and r["status"] == "WARN" for r in cpu.values())
    assert cpu["node3"]["detail"] == (
        "Intel(R) Xeon(R) Platinum 8380 · 40 cores · no AMX; the cluster mixes "
        "3× Intel(R) Xeon(R) Platinum 8480+ · 56 cores · AMX, 1× Intel(R) Xeon(R) Platinum 8380 · 40 cores · no AMX"
    )


def test_same_cpus_and_even_trials_pass_and_a_node_without_a_result_gets_no_comparison() -> None:
    reports = {"node1": _report(5.6, SPR), "node2": _report(5.9, SPR), "node3": {}, "node4": _report(None, SPR)}
    rows = xeonsd_doctor.compare_rows(reports)
    assert rows["node3"] == []
    assert [r["check"] for r in rows["node4"]] == ["cpu"]  # its trial failed: that row is the doctor's own FAIL
    assert {r["status"] for rs in rows.values() for r in rs} == {"PASS"}
    assert rows["node2"][0]["detail"] == "Intel(R) Xeon(R) Platinum 8480+ · 56 cores · AMX"


def test_doctor_s_straggler_rule_is_the_trainer_s() -> None:
    """One ratio and one list of causes (xeonsd.contracts.straggler_rule): the doctor's comparison, the trainer's watch and
    the inventory's (empty) defaults all mean it; no other file writes the number."""
    import re

    from repo_code import REPO

    from xeonsd.cluster.rank_stats import CAUSES, StragglerWatch
    from xeonsd.contracts.straggler_rule import STRAGGLER_RATIO
    from xeonsd.trainer.config import TrainConfig

    assert xeonsd_doctor.STRAGGLER_RATIO == STRAGGLER_RATIO == StragglerWatch().ratio
    assert TrainConfig.__dataclass_fields__["straggler_ratio"].default == STRAGGLER_RATIO
    assert xeonsd_doctor.STRAGGLER_CAUSES == CAUSES
    reports = {"node1": _report(5.6, SPR), "node2": _report(5.4, SPR), "node3": _report(9.1, SPR)}
    slow = xeonsd_doctor.compare_rows(reports)["node3"][1]["detail"]
    assert f"(over {STRAGGLER_RATIO}×)" in slow and slow.endswith("; ".join(CAUSES))
    number = re.compile(rf"(?<![\w.]){re.escape(str(STRAGGLER_RATIO))}(?![\w.])")
    for path in [
        *REPO.glob("train/src/**/*.py"),
        *REPO.glob("plugins/**/*.py"),
        *REPO.glob("roles/**/*.yml"),
        *REPO.glob("inventory/**/*.yml"),
    ]:
        if path.name == "straggler_rule.py":
            continue
        code = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
        assert not [ln for ln in code if number.search(ln)], f"{path}: a second straggler ratio"
