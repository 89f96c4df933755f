"""doctor.yml's table rows (plugins/filter/xeonsd_doctor.py) from recorded shapes of its tasks' results: a healthy
cluster, and each way a node or the cluster fails, with the row that names it."""

from __future__ import annotations

import base64
import json

from repo_code import ansible_code

xeonsd_doctor = ansible_code("xeonsd_doctor")
xeonsd_cluster = ansible_code("xeonsd_cluster")

ADDRESSES = {"node1": "10.231.1.11", "node2": "10.231.1.12", "node3": "10.231.1.13", "node4": "10.231.1.14"}
HOSTS = list(ADDRESSES)


def report(images: str = "PASS", train: str = "PASS") -> str:
    """The JSON line `xeonsd doctor --json` prints last."""
    checks = [
        {"name": "packages", "status": "PASS", "detail": "torch 2.13.0, diffusers 0.39.0"},
        {"name": "images", "status": images, "detail": "5 readable images" if images == "PASS" else "no images"},
        {"name": "train 1 step", "status": train, "detail": "loss 0.1 in 3.2 s"},
    ]
    return json.dumps({"ok": images == train == "PASS", "checks": checks})


def healthy() -> dict:
    """Registered results of a healthy 4-node cluster (only the keys the rows read)."""
    nodefile = "".join(f"{a}\n" for a in ADDRESSES.values())
    return {
        "results": [{"rc": 0, "stdout_lines": ["loading", report()], "stderr_lines": [""]} for _ in HOSTS],
        "ssh": [{"item": h, "rc": 0, "stderr_lines": []} for h in HOSTS],
        "nodefile": {"content": base64.b64encode(nodefile.encode()).decode()},
        "hello": {"rc": 0, "stdout_lines": ["hello: 16 ranks on 4 nodes, all-reduce ok"], "stderr_lines": []},
        "mpi_ranks": 16,
        "home": home(seen=[]),
    }


def home(seen: list[str], setting: str = "auto", probed: bool = True) -> dict:
    """roles/doctor/tasks/home.yml's doctor_home: which other nodes saw the primary's probe file."""
    return {"dir": "/home/devcloud", "setting": setting, "probed": probed, "why": "", "others": HOSTS[1:], "seen": seen}


def rows(case: dict) -> list[dict[str, str]]:
    return xeonsd_doctor.doctor_rows(
        HOSTS,
        case["results"],
        list(ADDRESSES.values()),
        case["ssh"],
        case["nodefile"],
        case["hello"],
        primary="node1",
        user="devcloud",
        expected=list(ADDRESSES.values()),
        nodefile_path="/etc/xeonsd/nodefile",
        mpi_ranks=str(case["mpi_ranks"]),
        ranks_per_node="4",
        check_limit_s=1200,
        hello_limit_s="600",
        ranks_mismatch=xeonsd_cluster.ranks_mismatch(case["mpi_ranks"], HOSTS, "4"),  # as roles/doctor/tasks/report.yml
        home=case["home"],
    )


def table(case: dict) -> dict[tuple[str, str], tuple[str, str]]:
    return {(r["node"], r["check"]): (r["status"], r["detail"]) for r in rows(case)}


def test_a_healthy_cluster_passes_every_row_in_inventory_order() -> None:
    result = rows(healthy())
    assert [(r["node"], r["check"]) for r in result] == [
        *((h, c) for h in HOSTS for c in ("packages", "images", "train 1 step", "ssh from primary")),
        ("cluster", "nodefile"),
        ("cluster", "mpirun hello"),
        ("cluster", "home"),
    ]
    assert {r["status"] for r in result} == {"PASS"}
    t = table(healthy())
    assert t["node3", "ssh from primary"] == ("PASS", "devcloud@node1 -> 10.231.1.13")
    assert t["cluster", "nodefile"] == (
        "PASS",
        "/etc/xeonsd/nodefile on node1: 4 nodes, primary first; 16 ranks = 4 nodes x 4",
    )
    assert t["cluster", "mpirun hello"] == ("PASS", "hello: 16 ranks on 4 nodes, all-reduce ok")


def test_an_unreachable_node_and_one_that_left_the_play_get_one_fail_row_each() -> None:
    case = healthy()
    case["results"][1] = {"unreachable": True, "msg": " Failed to connect to the host via ssh \n"}
    case["results"][2] = {}
    case["ssh"][1] = {"item": "node2", "rc": 255, "stderr_lines": ["", "ssh: connect to host port 22: No route", ""]}
    del case["ssh"][2]
    t = table(case)
    assert t["node2", "reach"] == ("FAIL", "unreachable from the controller: Failed to connect to the host via ssh")
    assert t["node3", "doctor"] == ("FAIL", "no result: the node left the play; see above")
    assert ("node2", "packages") not in t
    assert t["node2", "ssh from primary"] == (
        "FAIL",
        "devcloud@node1 -> 10.231.1.12: ssh: connect to host port 22: No route",
    )
    assert t["node3", "ssh from primary"] == (
        "FAIL",
        "devcloud@node1 -> 10.231.1.13: no result (the primary is unreachable?)",
    )


def test_the_wrapper_exit_codes_become_env_and_doctor_rows() -> None:
    case = healthy()
    case["results"][0] = {"rc": 90, "stderr": "/etc/xeonsd/env.sh is missing\n", "stdout_lines": []}
    case["results"][1] = {"rc": 91, "stderr": "no xeonsd on PATH\n", "stdout_lines": []}
    case["results"][2] = {"rc": 124, "stdout_lines": [], "stderr_lines": []}
    case["results"][3] = {"rc": 3, "stdout_lines": ["Traceback"], "stderr_lines": ["", "ImportError: torch", ""]}
    t = table(case)
    assert t["node1", "env"] == ("FAIL", "/etc/xeonsd/env.sh is missing")
    assert t["node2", "env"] == ("FAIL", "no xeonsd on PATH")
    assert t["node3", "doctor"] == ("FAIL", "xeonsd doctor did not finish within 1200 s")
    assert t["node4", "doctor"] == ("FAIL", "xeonsd doctor exited with rc 3: ImportError: torch")


def test_doctor_own_fail_rows_are_kept_and_rc_1_and_2_add_none() -> None:
    case = healthy()
    case["results"][1] = {"rc": 1, "stdout_lines": [report(images="FAIL")], "stderr_lines": []}
    case["results"][2] = {"rc": 2, "stdout_lines": [report(train="FAIL")], "stderr_lines": ["the model is missing"]}
    case["results"][3] = {"rc": 137, "stdout_lines": [report()], "stderr_lines": []}
    t = table(case)
    assert t["node2", "images"] == ("FAIL", "no images") and ("node2", "doctor") not in t
    assert t["node3", "train 1 step"][0] == "FAIL" and ("node3", "doctor") not in t
    assert t["node4", "images"][0] == "PASS"
    assert t["node4", "doctor"] == ("FAIL", "xeonsd doctor did not finish within 1200 s")


def test_the_nodefile_must_list_the_inventory_primary_first_with_mpi_ranks_that_fit() -> None:
    case = healthy()
    case["nodefile"] = {"failed": True, "msg": "file not found: /etc/xeonsd/nodefile"}
    assert table(case)["cluster", "nodefile"] == (
        "FAIL",
        "cannot read /etc/xeonsd/nodefile on node1: file not found: /etc/xeonsd/nodefile",
    )
    case["nodefile"] = {"content": base64.b64encode(b"10.231.1.12\n10.231.1.11\n").decode()}
    assert table(case)["cluster", "nodefile"] == (
        "FAIL",
        "/etc/xeonsd/nodefile on node1 lists 10.231.1.12 10.231.1.11; the inventory has 10.231.1.11 10.231.1.12 "
        "10.231.1.13 10.231.1.14 (primary first)",
    )
    case["nodefile"] = {"content": ""}
    assert "lists nothing;" in table(case)["cluster", "nodefile"][1]
    case = healthy()
    case["mpi_ranks"] = 15
    assert table(case)["cluster", "nodefile"] == (
        "FAIL",
        "mpi_ranks is 15 but the cluster has 4 nodes (node1, node2, node3, node4) x ranks_per_node 4 = 16. "
        "Fix: set mpi_ranks to 16 or change ranks_per_node.",
    )


def test_mpirun_hello_names_the_shared_cause_first() -> None:
    case = healthy()
    case["hello"] = {
        "rc": 1,
        "stdout_lines": [],
        "stderr_lines": [
            "[0] xeonsd hello: error: rank 3: timed out waiting for 16 ranks",
            "[1] xeonsd hello: error: rank 3: timed out waiting for 16 ranks",
            "[2] xeonsd hello: error: expected 16 ranks, mpirun started 12",
            "[5] xeonsd hello: error: rank 5: gloo connect refused",
        ],
    }
    assert table(case)["cluster", "mpirun hello"] == (
        "FAIL",
        "mpirun -n 16 -ppn 4 (rc 1): expected 16 ranks, mpirun started 12; rank 3: timed out waiting for 16 ranks",
    )


def test_mpirun_hello_timeouts_missing_env_and_no_result() -> None:
    def hello(h: dict) -> tuple[str, str]:
        case = healthy()
        case["hello"] = h
        return table(case)["cluster", "mpirun hello"]

    assert hello({"rc": 124, "stderr_lines": ["x"]}) == (
        "FAIL",
        "mpirun -n 16 -ppn 4 (rc 124): mpirun did not finish within 600 s",
    )
    assert hello({"rc": 90, "stderr": "/etc/xeonsd/env.sh is missing\n"})[1].endswith(
        "(rc 90): /etc/xeonsd/env.sh is missing"
    )
    assert hello({"rc": 91, "stderr": "no mpirun on PATH after sourcing /etc/xeonsd/env.sh\n"})[1].endswith(
        "(rc 91): no mpirun on PATH after sourcing /etc/xeonsd/env.sh"
    )
    no_wrapper = "timeout: failed to run command '/etc/xeonsd/run': No such file or directory"
    assert hello({"rc": 127, "stderr": no_wrapper + "\n"})[1].endswith(f"(rc 127): {no_wrapper}")
    assert hello({"rc": 7, "stderr_lines": ["", "mpirun: bad things", ""]})[1].endswith("(rc 7): mpirun: bad things")
    assert hello({"rc": 7, "stderr_lines": []})[1].endswith("(rc 7): no output")
    assert hello({"unreachable": True, "msg": "primary down "}) == ("FAIL", "not run on node1: primary down")
    assert hello({"skipped": True}) == ("FAIL", "not run on node1: no result")


def test_the_home_row_says_shared_or_own_and_fails_a_home_shared_by_some_or_against_shared_home() -> None:
    def row(h: dict) -> tuple[str, str]:
        return table({**healthy(), "home": h})["cluster", "home"]

    assert row(home(seen=[])) == ("PASS", "each node has its own /home/devcloud")
    status, detail = row(home(seen=HOSTS[1:]))
    assert status == "PASS" and detail.startswith("shared: every node sees node1's /home/devcloud (written once, by")
    assert row(home(seen=HOSTS[1:], setting="True"))[0] == "PASS"  # shared_home: true, as Jinja stringifies it
    assert row(home(seen=["node2"])) == (
        "FAIL",
        "shared by some nodes only: node2 see node1's /home/devcloud, node3, node4 do not",
    )
    assert row(home(seen=HOSTS[1:], setting="False")) == (
        "FAIL",
        "shared_home is false but the home is shared (node1's /home/devcloud)",
    )
    assert row(home(seen=[], setting="true")) == (
        "FAIL",
        "shared_home is true but the home is each node's own (node1's /home/devcloud)",
    )
    assert row({**home(seen=[], probed=False), "why": "Permission denied"}) == ("WARN", "not probed: Permission denied")


# The table itself (xeonsd_doctor_table): what roles/doctor/tasks/report.yml prints and fails with.
FIXES = {"images": "copy the images back: ansible-playbook provision.yml --limit {node}"}


def test_a_passing_table_has_aligned_columns_and_a_pass_verdict_that_counts_warnings() -> None:
    result = rows(healthy())
    result[0] = {**result[0], "status": "WARN"}
    report = xeonsd_doctor.doctor_table(result, FIXES)
    lines = report["lines"]
    assert report["verdict"] == "PASS" and report["failed"] == [] and report["message"] == ""
    assert len(lines) == 1 + len(result) + 1
    assert lines[0].split() == ["node", "check", "status", "detail"]
    # Every column starts where the header's does: node, check (as wide as "ssh from primary"), status (6).
    starts = [lines[0].index(word) for word in ("check", "status", "detail")]
    assert starts == [
        len("cluster") + 2,
        len("cluster") + 2 + len("ssh from primary") + 2,
        len("cluster") + 2 + len("ssh from primary") + 2 + 6 + 2,
    ]
    assert lines[1] == "node1    packages          WARN    torch 2.13.0, diffusers 0.39.0"
    assert all(line[starts[2] :].strip() == r["detail"] for line, r in zip(lines[1:], result, strict=False))
    assert lines[-1] == (
        f"RESULT: PASS ({len(result)} checks, 1 warnings): the cluster is ready for ansible-playbook finetune.yml"
    )


def test_a_failing_table_names_what_to_do_per_fail_and_the_play_fails_with_the_causes() -> None:
    case = healthy()
    case["results"][2] = {"rc": 1, "stdout_lines": [report(images="FAIL")], "stderr_lines": []}
    case["results"][3] = {"rc": 3, "stdout_lines": [], "stderr_lines": ["ImportError: " + "torch " * 80]}
    result = rows(case)
    table_report = xeonsd_doctor.doctor_table(result, FIXES)
    lines = table_report["lines"]
    assert table_report["verdict"] == "FAIL"
    assert [(r["node"], r["check"]) for r in table_report["failed"]] == [("node3", "images"), ("node4", "doctor")]
    assert lines[-3] == f"RESULT: FAIL (2 of {len(result)} checks failed, 0 warnings). What to do:"
    assert lines[-2] == "  node3 images: copy the images back: ansible-playbook provision.yml --limit node3"
    assert lines[-1] == "  node4 doctor: read the detail above"  # no fix for the check: the default
    # A long detail is cut at a word, within 300 characters in the table and 200 in the play's failure.
    (long_line,) = [line for line in lines if "ImportError" in line]
    detail = long_line[long_line.index("xeonsd doctor exited") :]
    assert detail.endswith("torch...") and len(detail) <= 300
    message = table_report["message"]
    assert message.startswith(
        "doctor: 2 check(s) failed on node3, node4: node3 images (no images); node4 doctor "
        "(xeonsd doctor exited with rc 3: ImportError: torch torch"
    )
    assert message.endswith("torch...). See the table above for what to do.")
    assert len(message) < 200 + 150


def test_a_detail_just_over_the_limit_is_kept_whole_as_jinja_truncate_did() -> None:
    assert xeonsd_doctor._truncate("x" * 305, 300) == "x" * 305
    assert xeonsd_doctor._truncate("ab " * 102, 300) == ("ab " * 99).rstrip() + "..."
