"""provision.yml on a real 4-node test cluster: builds every node, is idempotent, runs in check mode, and
rebuilds a wiped node with --limit alone. The tests run in file order and share one cluster."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

from harness import NODES, REPO, Cluster
from runner import PlaybookRun, run_playbook

ENV = "/opt/diffuser"
# requirements.txt's diffusers pin: the test cluster (diffusers_source: sdist) builds its wheel from the index's sdist.
DIFFUSERS_PIN = next(
    line.split("#")[0].replace(" ", "")
    for line in (REPO / "requirements.txt").read_text().splitlines()
    if re.match(r"diffusers\s*==", line)
)


def wheel_builds(run: PlaybookRun, name: str) -> list[str]:
    """The hosts on which the run's "Build the wheel - <name>" task ran (not skipped): one at most, the controller's
    run_once."""
    return [
        e["event_data"]["host"]
        for e in run.events
        if e.get("event") in ("runner_on_ok", "runner_on_failed")
        and e["event_data"].get("task", "").startswith("Build the wheel - ")
        # pip wheel --wheel-dir <controller dir>/<name>-<id>.partial (the event's task name may be untemplated)
        and f"/{name}-" in str((e["event_data"].get("res") or {}).get("cmd"))
    ]


def installed_wheel(cluster: Cluster, node: str, name: str) -> tuple[str, str]:
    """(id, marker content) of the controller-built wheel ``name`` installed on ``node``: ml_stack leaves one
    <env>/.<name>-<id> for the installed wheel (and forgets those before), holding "<wheel file> (<source key>)"."""
    out = cluster.ssh(node, f"grep -H . {ENV}/.{name}-*", check=False).stdout.strip().splitlines()
    assert len(out) == 1, f"{node}: {ENV}/.{name}-* should be one marker, the installed wheel's: {out}"
    path, content = out[0].split(":", 1)
    return path.rsplit("-", 1)[1], content


def assert_node_works(cluster: Cluster, node: str) -> None:
    """The node's env imports the stack, has mpirun, preloads tcmalloc, and holds the images and the model."""
    out = cluster.ssh(node, f"{ENV}/bin/python -c 'import torch, diffusers, xeonsd; print(torch.__version__)'").stdout
    assert out.strip(), f"{node}: no torch version"
    cluster.ssh(node, f"test -x {ENV}/bin/mpirun")
    # The wrapper the roles run commands with: env.sh sourced, and without its LD_PRELOAD on request.
    maps = "/etc/xeonsd/run {}python -c 'print(open(\"/proc/self/maps\").read())'"
    assert "libtcmalloc" in cluster.ssh(node, maps.format("")).stdout, f"{node}: tcmalloc is not preloaded by env.sh"
    assert "libtcmalloc" not in cluster.ssh(node, maps.format("--no-preload ")).stdout, f"{node}: --no-preload"
    # The images and their captions (metadata.jsonl), byte for byte the controller's.
    staged = cluster.ssh(node, "cd /home/devcloud/dicoo && sha256sum *").stdout.split("\n")
    staged = dict(reversed(line.split()) for line in staged if line.strip())
    originals = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (cluster.assets_dir / "dicoo").iterdir()}
    assert staged == originals and len(originals) == 6 and "metadata.jsonl" in staged, f"{node}: {sorted(staged)}"
    cluster.ssh(node, "test -f /home/devcloud/models/tiny-sd/model_index.json")


def test_fresh_provision_builds_every_node(provisioned: Cluster, fresh_provision: PlaybookRun) -> None:
    print(f"\nfresh provision ({NODES} nodes): {fresh_provision.seconds:.1f} s")
    assert set(fresh_provision.recap) == set(provisioned.nodes)
    for node in provisioned.nodes:
        assert_node_works(provisioned, node)


def test_diffusers_and_xeonsd_are_built_once_on_the_controller_and_installed_from_its_wheels(
    provisioned: Cluster, fresh_provision: PlaybookRun
) -> None:
    # Built on the controller at most once in the run (the wheel may already be in .cache/wheels from an earlier
    # session: then no build at all), never on a node.
    for name in ("diffusers", "xeonsd"):
        assert len(wheel_builds(fresh_provision, name)) <= 1, wheel_builds(fresh_provision, name)
    ids = {node: installed_wheel(provisioned, node, "diffusers") for node in provisioned.nodes}
    assert len(set(ids.values())) == 1, ids  # every node installed the same wheel
    ((wid, marker),) = set(ids.values())
    built = REPO / ".cache" / "wheels" / f"diffusers-{wid}"
    (wheel,) = built.glob("*.whl")
    assert re.fullmatch(r"diffusers-[\d.]+-py3-none-any\.whl", wheel.name), wheel.name
    assert (
        marker
        == f"{wheel.name} (sdist {DIFFUSERS_PIN})"
        == f"{wheel.name} ({(built / '.complete').read_text().strip()})"
    )
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    for node in provisioned.nodes:
        found = provisioned.ssh(node, f"sha256sum /var/cache/xeonsd/wheels/*/diffusers-{wid}/{wheel.name}").stdout
        assert found.split()[0] == digest, f"{node}: {found}"
        # Nothing of Diffusers' or xeonsd's source reached the node: no clone, no archive, no sdist, no packed train/.
        leftovers = provisioned.ssh(
            node,
            "ls -d /var/cache/xeonsd/diffusers /var/cache/xeonsd/xeonsd-src.tar /var/cache/xeonsd/*.tar.gz "
            "/var/cache/xeonsd/wheelhouse/*/diffusers-*.tar.gz",
            check=False,
        ).stdout
        assert leftovers.strip() == "", f"{node}: {leftovers}"
        xid, xmarker = installed_wheel(provisioned, node, "xeonsd")
        assert xmarker.startswith("xeonsd-") and "(source sha1 " in xmarker, xmarker
        assert (REPO / ".cache" / "wheels" / f"xeonsd-{xid}" / ".complete").exists()
    # The offline wheelhouse the nodes got holds that same wheel (its downloads name it as a file) and no other
    # Diffusers (no sdist, no wheel from the index).
    (wheelhouse_id,) = provisioned.ssh("node1", "ls /var/cache/xeonsd/wheelhouse").stdout.split()
    wheelhouse = REPO / ".cache" / "wheelhouse" / wheelhouse_id
    assert sorted(p.name for p in wheelhouse.glob("diffusers-*")) == [wheel.name]
    assert (wheelhouse / wheel.name).read_bytes() == wheel.read_bytes()


def test_nodes_keep_their_files_private(provisioned: Cluster) -> None:
    provisioned.ssh("node2", "echo node2 > /etc/xeonsd/private-probe")
    try:
        assert provisioned.ssh("node1", "test -e /etc/xeonsd/private-probe", check=False).returncode != 0
        assert provisioned.ssh("node2", "cat /etc/xeonsd/private-probe").stdout.strip() == "node2"
    finally:
        provisioned.ssh("node2", "rm -f /etc/xeonsd/private-probe")


def test_nodefile_lists_the_primary_first(provisioned: Cluster) -> None:
    nodefile = provisioned.ssh("node2", "cat /etc/xeonsd/nodefile").stdout.split()
    assert nodefile == [provisioned.address(i) for i in range(1, NODES + 1)]
    env = provisioned.ssh("node1", ". /etc/xeonsd/env.sh && env").stdout
    for line in (
        f"MASTER_ADDR={provisioned.address(1)}",  # the slot's subnet (XEONSD_TEST_CLUSTER_SLOT)
        "MASTER_PORT=29500",
        "CCL_ATL_TRANSPORT=ofi",
        "CCL_WORKER_COUNT=1",
        "I_MPI_HYDRA_IFACE=eth0",
    ):
        assert line in env.splitlines(), f"{line} not in env.sh's environment"


def test_cluster_user_reaches_every_node_with_checked_host_keys(provisioned: Cluster) -> None:
    key = provisioned.ssh("node1", "stat -c %a /home/devcloud/.ssh/xeonsd_cluster_ed25519").stdout.strip()
    assert key == "600"
    assert provisioned.ssh("node2", "test -e /home/devcloud/.ssh/xeonsd_cluster_ed25519", check=False).returncode
    for i in range(1, NODES + 1):
        # StrictHostKeyChecking=yes and BatchMode come from ~/.ssh/config: a wrong host key fails here.
        out = provisioned.ssh("node1", f"ssh {provisioned.address(i)} cat /etc/xeonsd/nodefile", user="devcloud")
        assert out.stdout.split()[0] == provisioned.address(1)


def assert_a_rank_on_every_node(cluster: Cluster, before: str = "", timeout: float = 180) -> None:
    """mpirun from the primary, as the job's account, with the nodefile: one rank per node, each running ``before``
    (a shell command; it must succeed) and then printing its node's address, every node's found."""
    rank = f"{before} && ip -4 -o addr show eth0" if before else "ip -4 -o addr show eth0"
    cmd = f'. /etc/xeonsd/env.sh && mpirun -f $XEONSD_NODEFILE -n {NODES} -ppn 1 /bin/sh -c "{rank}"'
    out = cluster.ssh("node1", cmd, user="devcloud", timeout=timeout).stdout
    for i in range(1, NODES + 1):
        assert f"{cluster.address(i)}/24" in out, out


def test_mpirun_starts_ranks_on_every_node(provisioned: Cluster) -> None:
    assert_a_rank_on_every_node(provisioned)


def test_second_run_changes_nothing(provisioned: Cluster) -> None:
    result = run_playbook("provision.yml", provisioned.inventory, state_dir=provisioned.state_dir, name="second-run")
    print(f"\nsecond run ({NODES} nodes, nothing to do): {result.seconds:.1f} s")
    assert result.rc == 0, result.tail()
    assert result.changed() == {node: 0 for node in provisioned.nodes}, result.recap
    assert wheel_builds(result, "diffusers") == wheel_builds(result, "xeonsd") == []  # nothing is built again


def test_check_mode_runs_through(provisioned: Cluster) -> None:
    """--check on the primary and one worker (the tasks of each kind of node; the other workers run the worker's):
    every task runs through in check mode, and on the built cluster it would change nothing."""
    result = run_playbook(
        "provision.yml",
        provisioned.inventory,
        *("--check", "--limit", "node1,node2"),
        state_dir=provisioned.state_dir,
        name="check-mode",
    )
    assert result.rc == 0, result.tail()
    assert result.changed() == {"node1": 0, "node2": 0}, result.recap


def test_limit_rebuilds_a_wiped_node_without_the_others_from_a_staged_diffusers_archive(
    provisioned: Cluster, tmp_path: Path
) -> None:
    """node3 wiped like a reinstalled server is rebuilt by provision.yml --limit node3 alone, at an air-gapped site
    with diffusers_source: git that stages a source archive of Diffusers on the controller: the controller builds
    its wheel instead of cloning (the test cluster reaches no git hosting, so a clone would fail) and node3 installs
    that wheel; the rebuilt node's env takes ranks in an mpirun across the cluster. (One rebuild for both: each
    costs two minutes on 2 cores.) The stand-in archive is the pinned sdist,
    fetched by the controller's pip from the index the wheelhouse comes from; a new Diffusers wheel is a new
    wheelhouse too (its downloads name the wheel), so the rebuild downloads the wheelhouse again. (That a second run
    builds no wheel from the same archive: tests/ansible/test_wheels.py, on this machine.)"""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", "diffusers"]
        + ["--dest", str(tmp_path), DIFFUSERS_PIN],
        check=True,
        timeout=600,
    )
    (archive,) = tmp_path.glob("diffusers-*.tar.gz")
    sha256 = hashlib.sha256(archive.read_bytes()).hexdigest()
    inventory = provisioned.write_inventory(
        tmp_path / "inventory.yml",
        overrides={
            "diffusers_source": "git",
            "diffusers_source_archive": str(archive),
            "diffusers_source_archive_sha256": sha256,
        },
    )
    # Wipe node3 (its sshd and host key stay), and forget every cached fact, so the run can only use the inventory
    # for the other nodes.
    for d in provisioned.private_dirs:
        root = provisioned.private_dir("node3", d)
        for child in root.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    shutil.rmtree(provisioned.state_dir / "facts", ignore_errors=True)
    assert provisioned.ssh("node3", f"test -e {ENV}/bin/python", check=False).returncode != 0

    result = run_playbook(
        "provision.yml", inventory, "--limit", "node3", state_dir=provisioned.state_dir, name="limit-node3"
    )
    print(f"\nrebuild of one wiped node with --limit (Diffusers from a staged archive): {result.seconds:.1f} s")
    assert result.rc == 0, result.tail()
    assert set(result.recap) == {"node3"}, result.recap
    assert_node_works(provisioned, "node3")
    out = provisioned.ssh("node1", f"ssh {provisioned.address(3)} cat /etc/xeonsd/nodefile", user="devcloud")
    assert out.stdout.split()[0] == provisioned.address(1)
    # Diffusers: built once (run_once), or not at all when an earlier session built this archive's wheel (.cache
    # persists), never cloned; node3 holds the archive's wheel and no clone.
    assert wheel_builds(result, "diffusers") in ([], ["node3"]) and "Clone Diffusers" not in result.output
    wid, marker = installed_wheel(provisioned, "node3", "diffusers")
    assert marker.endswith(f" (archive sha256 {sha256})"), marker
    assert (REPO / ".cache" / "wheels" / f"diffusers-{wid}" / ".complete").read_text() == f"archive sha256 {sha256}\n"
    assert provisioned.ssh("node3", "test -e /var/cache/xeonsd/diffusers", check=False).returncode != 0

    # The rebuilt node takes ranks again in a job across the cluster: mpirun from the primary, as the job's account,
    # one rank per node (its SSH trust, its MPI and its env; training itself on the rebuilt node: test_shared_home's
    # job, which runs on every node's env).
    assert_a_rank_on_every_node(provisioned, "python -c 'import torch, diffusers'", timeout=300)
