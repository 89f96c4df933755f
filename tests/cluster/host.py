"""The host under the test cluster: commands run on it, and its /usr as the nodes' shared OS ("base image").

The nodes share the host's /usr and Debian package database but have no route to a package mirror, so the OS
packages they need (the base ones below and the roles' own list) are installed on the host before they start, and
the cluster account lives in the host's /etc/passwd (like an LDAP account on real clusters).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

ROLES = Path(__file__).resolve().parents[2] / "roles"
# The roles' OS packages for Debian/Ubuntu, as (vars file, its list variable): what the system_packages role, the
# slurm role with slurm_install: true and serve.yml's front (HAProxy) would install on a real node. The slurm
# role's and HAProxy too, whether or not a test turns them on: a node here cannot download them, and the packages
# start no daemon here (the roles start them).
ROLE_PACKAGE_LISTS = (
    (ROLES / "system_packages" / "vars" / "Debian.yml", "system_packages_os"),
    (ROLES / "slurm" / "vars" / "Debian.yml", "slurm_packages"),
    (ROLES / "serve_frontend" / "vars" / "Debian.yml", "serve_frontend_packages"),
)
# What every node needs before Ansible can reach it (besides the roles' own OS packages).
BASE_PACKAGES = ("openssh-server", "sudo", "python3", "python3-apt", "iproute2", "util-linux")


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run a command on the host; a non-zero exit raises, with its output captured."""
    return subprocess.run(argv, check=True, text=True, capture_output=True, **kwargs)


def debian_packages_of_roles() -> list[str]:
    packages = []
    for path, key in ROLE_PACKAGE_LISTS:
        data = yaml.safe_load(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get(key), list):
            raise ValueError(f"{path}: expected a list under {key}")
        packages += data[key]
    return packages


def ensure_packages(wanted: list[str] | tuple[str, ...]) -> None:
    """Install on the host those of the Debian packages `wanted` that are not installed yet."""
    missing = [
        p
        for p in wanted
        if "install ok installed"
        not in subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], text=True, capture_output=True).stdout
    ]
    if missing:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], check=True, env=env)


def ensure_base_image(cluster_user: str, cluster_user_home: str) -> None:
    """The nodes' shared OS: the base packages, the roles' OS packages, and the cluster account (its home is
    made on each node, as one of the node's private directories)."""
    wanted = [*BASE_PACKAGES, *debian_packages_of_roles()]
    ensure_packages(wanted)
    if subprocess.run(["getent", "passwd", cluster_user], capture_output=True).returncode != 0:
        # Shared /etc/passwd, like an LDAP account on real clusters; "*": key logins only, not locked.
        run(
            [
                "useradd",
                "--home-dir",
                cluster_user_home,
                "--no-create-home",
                "--shell",
                "/bin/bash",
                "--password",
                "*",
                "--user-group",
                cluster_user,
            ]
        )
