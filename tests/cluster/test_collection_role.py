"""docs/collection.md's example on the real 4-node test cluster: a user's own playbook that uses one role of the
collection (xeonsd.cluster.dataset), run from outside the repository with the collection installed from its built
archive and an inventory of hosts and SSH settings alone (none of this repository's group_vars or ansible.cfg)."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import yaml
from galaxy_collection import build, docs_example, install, user_env
from harness import Cluster
from repo_code import VENV_BIN

CONCEPT = "collection-example"


def user_inventory(cluster: Cluster, path: Path) -> Path:
    """What a user's hosts.yml says: the nodes in the groups the roles expect, how to reach them, nothing else."""
    hosts = {node: {"ansible_host": cluster.address(int(node.removeprefix("node")))} for node in cluster.nodes}
    connection = {
        "ansible_user": "root",
        "ansible_python_interpreter": "/usr/bin/python3",
        "ansible_ssh_private_key_file": str(cluster.admin_key),
        "ansible_ssh_common_args": f"-o UserKnownHostsFile={cluster.known_hosts} -o IdentitiesOnly=yes",
    }
    first, *rest = cluster.nodes
    groups = {"primary": {"hosts": {first: hosts[first]}}, "workers": {"hosts": {n: hosts[n] for n in rest}}}
    path.write_text(yaml.safe_dump({"all": {"children": {"cluster": {"children": groups, "vars": connection}}}}))
    return path


def test_the_docs_example_stages_images_with_the_installed_collections_dataset_role(
    provisioned: Cluster, tmp_path: Path
) -> None:
    install(build(tmp_path / "build"), tmp_path / "collections")
    user = tmp_path / "ops-playbooks"
    user.mkdir()
    (user / "stage-concept.yml").write_text(docs_example())
    source = provisioned.assets_dir / "dicoo"
    argv = [
        str(VENV_BIN / "ansible-playbook"),
        *("-i", str(user_inventory(provisioned, user / "hosts.yml")), "stage-concept.yml"),
        *("-e", f"concept_dir={source}", "-e", f"concept={CONCEPT}"),
    ]
    env = user_env(tmp_path / "collections")
    try:
        done = subprocess.run(argv, cwd=user, env=env, text=True, capture_output=True, timeout=600)
        said = done.stdout + done.stderr
        assert done.returncode == 0, said[-5000:]
        # the role ran from the installed collection, and with it the verified_tree role it imports
        assert "TASK [xeonsd.cluster.dataset : List the controller's images]" in said, said[-3000:]
        assert "TASK [xeonsd.cluster.verified_tree : Unpack the tree where the node's files differ" in said
        # Every node has the controller's images, owned by the training account.
        expected = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in source.iterdir() if p.is_file()}
        assert len([n for n in expected if n.endswith(".png")]) == 5
        for node in provisioned.nodes:
            staged = provisioned.private_dir(node, "/home/devcloud") / CONCEPT
            got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in staged.iterdir()}
            assert got == expected, node
            owner = provisioned.ssh(node, f"stat -c %U /home/devcloud/{CONCEPT}/{min(expected)}").stdout.strip()
            assert owner == "devcloud", (node, owner)
        # The images were packed once, where the example says (beside the user's playbook).
        assert len(list((user / ".cache").glob("*.tar"))) == 1
    finally:
        for node in provisioned.nodes:
            provisioned.ssh(node, f"rm -rf /home/devcloud/{CONCEPT}", check=False)
