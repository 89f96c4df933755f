"""doctor.yml on the real 4-node test cluster: every node trains one step with the job's arguments, the primary
checks the nodefile, SSH and an mpirun hello across all ranks, and one table names what is wrong where."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess

from harness import NODES, Cluster
from runner import REPO, VENV_BIN, PlaybookRun, run_playbook

NODE_CHECKS = ("packages", "tcmalloc", "method", "images", "captions", "model", "train 1 step", "ssh from primary")
RANKS = 4 * NODES  # the test cluster runs 4 ranks per node (group_vars/cluster.yml)
OTHER_METHOD = {"textual_inversion": "lora", "lora": "textual_inversion", "full": "lora"}


def report(result: PlaybookRun) -> list[str]:
    """The lines of the doctor's table, read from the report task's JSON output."""
    out = result.output
    start = out.index("TASK [xeonsd.cluster.doctor : Doctor's report")
    start = out.index("=> {", start) + len("=> ")
    end = out.index("\n}\n", start) + 2
    return json.loads(out[start:end])["msg"]


def rows(lines: list[str]) -> dict[tuple[str, str], tuple[str, str]]:
    """{(node, check): (status, detail)} from the table (columns are separated by two or more spaces)."""
    table = {}
    for line in lines[1:]:
        if line.startswith("RESULT:"):
            break
        node, check, status, detail = re.split(r"\s{2,}", line, maxsplit=3)
        table[(node, check)] = (status, detail)
    return table


def show(result: PlaybookRun, what: str) -> list[str]:
    lines = report(result)
    print(f"\n{what}: {result.seconds:.1f} s wall (log: {result.log})\n" + "\n".join(lines))
    return lines


def test_doctor_in_check_mode_flags_a_node_without_images_and_an_unreachable_node_and_passes_the_others(
    provisioned: Cluster, tmp_path
) -> None:
    """Two faults in one run, and that run in --check mode (one doctor run on 2 cores costs a minute and more):
    node3's images are deleted, and the controller cannot reach node4 (a wrong SSH port in the inventory; the MPI
    network itself is fine). The checks only read, so --check runs every one of them for real, the trial step
    included: node3 fails its images check and skips its trial step, node4 gets a FAIL row with the cause, node1
    and node2 pass every check, trial step included, the cluster checks (the nodefile, an mpirun hello over every
    rank) still run, and nothing is changed. (doctor without --check on a healthy cluster, RESULT: PASS and rc 0:
    test_shared_home's run.)"""
    images = provisioned.private_dir("node3", "/home/devcloud") / "dicoo"
    originals = provisioned.assets_dir / "dicoo"
    saved = {p.name: p.stat() for p in sorted(images.iterdir())}
    assert sorted(saved) == sorted(p.name for p in originals.iterdir()), "node3's images are not the dataset's"
    provisioned.ssh("node3", "rm -f /home/devcloud/dicoo/*")
    inventory = provisioned.write_inventory(tmp_path / "inventory.yml", host_overrides={"node4": {"ansible_port": 2}})
    try:
        result = run_playbook(
            "doctor.yml",
            inventory,
            "--check",
            state_dir=provisioned.state_dir,
            name="doctor-check-node3-no-images-node4-unreachable",
        )
        lines = show(result, "doctor.yml --check, node3 without images, node4 unreachable from the controller")
        assert result.rc != 0, result.tail()
        table = rows(lines)
        status, detail = table[("node3", "images")]
        assert status == "FAIL" and "/home/devcloud/dicoo holds no images" in detail, detail
        # The trial step is not attempted on a node that already failed a check, and says so.
        assert table[("node3", "train 1 step")] == ("FAIL", "skipped: fix the failures above first")
        status, detail = table[("node4", "reach")]
        assert status == "FAIL" and "unreachable from the controller" in detail and "port 2" in detail, detail
        for node in ("node1", "node2"):
            for check in NODE_CHECKS:
                assert table[(node, check)][0] == "PASS", (node, check, table[(node, check)])
            # This machine has no AMX: a warning, not a failure (WARN rows do not fail the play).
            assert table[(node, "amx")][0] in ("PASS", "WARN")
            assert table[(node, "train 1 step")][1].startswith("loss ")
            # The nodes side by side: one CPU model here (PASS), and each trial step against the median (the
            # trials share this machine's 2 cores, so the verdict itself is left to chance: WARN rows pass).
            assert table[(node, "cpu")][0] == "PASS" and " cores · " in table[(node, "cpu")][1]
            assert "× the median " in table[(node, "straggler")][1], table[(node, "straggler")]
        assert table[("node3", "ssh from primary")][0] == "PASS"
        assert table[("node4", "ssh from primary")][0] == "PASS"
        assert table[("cluster", "nodefile")][0] == "PASS"
        assert table[("cluster", "mpirun hello")] == (
            "PASS",
            f"hello: {RANKS} ranks on {NODES} nodes, backend gloo, all-reduce ok (sum={RANKS * (RANKS + 1) // 2})",
        )
        failed = sorted((node, check) for (node, check), (status, _) in table.items() if status == "FAIL")
        assert failed == [("node3", "images"), ("node3", "train 1 step"), ("node4", "reach")], failed
        # The verdict names what to do for each; the play's failure names the nodes and the causes.
        fixes = lines[lines.index(next(x for x in lines if x.startswith("RESULT: FAIL (3 of "))) + 1 :]
        assert "  node3 images: copy the images back: ansible-playbook provision.yml --limit node3" in fixes
        assert any(x.startswith("  node4 reach: make node4 reachable over SSH from the controller") for x in fixes)
        # The controller's own view, as data: node4 could not be reached on port 2; the doctor's failure, on the
        # primary, names both nodes and the causes.
        failures = result.failures()
        assert any(f.host == "node4" and "port 2" in f.msg for f in failures), failures
        (doctor,) = [f for f in failures if f.host == "node1"]
        said = "doctor: 3 check(s) failed on node3, node4: node3 images (--train_data_dir /home/devcloud/dicoo holds no"
        assert doctor.msg.startswith(said), doctor
        # --check changed nothing, and left nothing under the job account's home.
        assert set(result.changed().values()) == {0}, result.recap
        for node in provisioned.nodes:
            assert not (provisioned.private_dir(node, "/home/devcloud") / ".ansible").exists(), node
    finally:
        # Put node3's images back as the dataset role left them (same bytes, owner, group and mode), so that a
        # later provision run finds nothing to do.
        for name, st in saved.items():
            dest = images / name
            shutil.copyfile(originals / name, dest)
            os.chown(dest, st.st_uid, st.st_gid)
            os.chmod(dest, st.st_mode & 0o7777)
    for name in saved:
        digest = hashlib.sha256((images / name).read_bytes()).hexdigest()
        assert digest == hashlib.sha256((originals / name).read_bytes()).hexdigest(), name


def test_doctor_tunes_the_rank_layout_and_ranks_per_node_auto_uses_its_best(provisioned: Cluster, tmp_path) -> None:
    """-e tune_layout=true: every split of the primary's cores trains the job's arguments (one round of one step
    after a warm-up here); the result on the controller is what ranks_per_node: auto (and mpi_ranks: auto) become."""
    from xeonsd.contracts import layout_result

    layout_file = tmp_path / "layout.json"
    result = run_playbook(
        "doctor.yml",
        provisioned.inventory,
        *("-e", "tune_layout=true", "-e", f"layout_result_file={layout_file}"),
        *("-e", "doctor_tune_rounds=1", "-e", "doctor_tune_steps=1", "-e", "doctor_tune_warmup=1"),
        state_dir=provisioned.state_dir,
        name="doctor-tune-layout",
    )
    print(f"\ndoctor.yml -e tune_layout=true: {result.seconds:.1f} s wall (log: {result.log})")
    assert result.rc == 0, result.tail()
    measured = layout_result.read(layout_file)
    shapes = [(m["ranks_per_node"], m["threads_per_rank"]) for m in measured["layouts"]]
    assert shapes == layout_result.layouts(measured["cores"]) and len(shapes) >= 2
    assert all(m["status"] == "measured" and m["median_images_per_s"] > 0 for m in measured["layouts"])
    best = measured["best"]["ranks_per_node"]
    measured_method = next(a.split("=", 1)[1] for a in measured["train_args"] if a.startswith("--method="))
    assert f"best: {best} ranks per node x {measured['best']['threads_per_rank']} threads" in result.output
    # Only the result file on the controller changed (counted for node1, the primary the task ran for).
    assert result.changed() == {node: int(node == "node1") for node in provisioned.nodes}, result.recap

    # The inventory's ranks_per_node: auto and mpi_ranks: auto, through the play's own filters and variables.
    # a table: each flag beside its value (ruff would put one item per line)
    shown = subprocess.run(
        [str(VENV_BIN / "ansible"), "-i", str(provisioned.inventory), "node1", "-m", "ansible.builtin.debug",
         "-a", "msg={{ [ranks_per_node | xeonsd.cluster.xeonsd_ranks_per_node(layout_result_file),"
               " mpi_ranks | xeonsd.cluster.xeonsd_mpi_ranks(groups['cluster'], ranks_per_node | xeonsd.cluster.xeonsd_ranks_per_node(layout_result_file))] }}",
         "-e", "ranks_per_node=auto", "-e", "mpi_ranks=auto", "-e", f"layout_result_file={layout_file}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert re.search(rf'"msg": \[\s*{best},\s*{best * NODES}\s*\]', shown.stdout), shown.stdout
    # The finetune role's warning for a result measured with other training arguments (here another method).
    # a table: each flag beside its value (ruff would put one item per line)
    stale = subprocess.run(
        [str(VENV_BIN / "ansible"), "-i", str(provisioned.inventory), "node1", "-m", "ansible.builtin.debug",
         "-a", "msg=[{{ layout_result_file | xeonsd.cluster.xeonsd_layout_stale(finetune_train_argv) }}]",
         "-e", f"layout_result_file={layout_file}", "-e", f"finetune_method={OTHER_METHOD[measured_method]}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert stale.returncode == 0, stale.stdout + stale.stderr
    assert f"the job now has --method={OTHER_METHOD[measured_method]}" in stale.stdout, stale.stdout
    layout_file.unlink()
    # a table: each flag beside its value (ruff would put one item per line)
    missing = subprocess.run(
        [str(VENV_BIN / "ansible"), "-i", str(provisioned.inventory), "node1", "-m", "ansible.builtin.debug",
         "-a", "msg={{ ranks_per_node | xeonsd.cluster.xeonsd_ranks_per_node(layout_result_file) }}",
         "-e", "ranks_per_node=auto", "-e", f"layout_result_file={layout_file}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert missing.returncode != 0 and "doctor.yml -e tune_layout=true" in missing.stdout + missing.stderr
