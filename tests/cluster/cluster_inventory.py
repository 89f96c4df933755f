"""The test cluster's inventory: where the nodes' directories are (read from the repository's own inventory), the
test cluster's settings (group_vars/cluster.yml next to this file), and the inventory directory a run writes.

A written inventory directory holds inventory.yml (the hosts: primary and workers under the group cluster),
group_vars/all (a symlink to the repository's inventory/group_vars/all, so the defaults are the real ones) and
group_vars/cluster.yml (the test cluster's settings and the values computed for the run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import yaml

REPO = Path(__file__).resolve().parents[2]
# The defaults every inventory gets (paths.yml, cluster.yml, ...).
REPO_GROUP_VARS = REPO / "inventory" / "group_vars" / "all"
# What the test cluster sets differently (static values only; the harness adds those it computes per run).
SETTINGS_FILE = Path(__file__).resolve().parent / "group_vars" / "cluster.yml"
# The node directories that are private to each node (bind mounts in its mount namespace), by the inventory
# variable that names them; /etc/ssh is private too (the node's own host key).
PRIVATE_DIR_VARS = ("diffuser_env_prefix", "cluster_user_home", "xeonsd_etc_dir", "xeonsd_cache_dir")
# The slurm role's node directories (its defaults: slurm.conf, slurmctld's state, slurmd's spool, the logs, the munge
# key's directory), private to each node too, so the role runs on the test cluster with its defaults, as on separate
# servers. Apart from the others: the running daemons write there (the snapshot of the nodes' files leaves them out).
SLURM_ROLE_DEFAULTS = REPO / "roles" / "slurm" / "defaults" / "main.yml"
SLURM_DIR_VARS = ("slurm_conf_dir", "slurm_state_dir", "slurm_spool_dir", "slurm_log_dir", "slurm_munge_key")


def load_mapping(path: Path) -> dict[str, Any]:
    """A YAML file that holds variables; an empty file holds none."""
    data = yaml.safe_load(path.read_text())
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of variable names to values, got {type(data).__name__}")
    return data


def load_settings() -> dict[str, Any]:
    """The test cluster's static settings (SETTINGS_FILE)."""
    settings = load_mapping(SETTINGS_FILE)
    ppn = settings.get("ranks_per_node")
    if isinstance(ppn, bool) or not isinstance(ppn, int) or ppn < 1:
        raise ValueError(f"{SETTINGS_FILE}: ranks_per_node must be a positive integer, got {ppn!r}")
    return settings


def inventory_variables() -> dict[str, Any]:
    """The variables the test cluster's nodes get from group_vars (before any per-run value): the repository's
    group_vars/all, file by file in Ansible's order, then the test cluster's settings."""
    files = sorted([*REPO_GROUP_VARS.glob("*.yml"), *REPO_GROUP_VARS.glob("*.yaml")])
    if not files:
        raise FileNotFoundError(f"no variable files in {REPO_GROUP_VARS}")
    variables: dict[str, Any] = {}
    for path in files:
        variables.update(load_mapping(path))
    variables.update(load_settings())
    return variables


def resolve(name: str, variables: dict[str, Any]) -> Any:
    """The value of inventory variable `name`, its Jinja templates rendered from `variables` (as Ansible would,
    for values that only refer to other inventory variables, such as cluster_user_home)."""
    if name not in variables:
        raise KeyError(f"{name} is not set in {REPO_GROUP_VARS} nor in {SETTINGS_FILE}")
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    value = variables[name]
    for _ in range(10):  # a template may name a variable that is itself a template
        if not (isinstance(value, str) and "{{" in value):
            return value
        try:
            value = env.from_string(value).render(variables)
        except jinja2.TemplateError as exc:
            raise ValueError(f"{name}: cannot render {variables[name]!r} from the inventory alone: {exc}") from exc
    raise ValueError(f"{name}: {variables[name]!r} still holds a template after 10 renderings")


def cluster_user() -> str:
    """The account that owns the data and runs mpirun on the nodes (cluster_user)."""
    return str(resolve("cluster_user", inventory_variables()))


def cluster_user_home() -> str:
    return str(resolve("cluster_user_home", inventory_variables()))


def node_private_dirs() -> tuple[str, ...]:
    """The node directories each node keeps to itself, as the inventory names them (absolute paths)."""
    variables = inventory_variables()
    dirs = tuple(str(resolve(name, variables)) for name in PRIVATE_DIR_VARS)
    for name, d in zip(PRIVATE_DIR_VARS, dirs, strict=True):
        if not d.startswith("/"):
            raise ValueError(f"{name} is {d!r}: a node directory of the test cluster must be an absolute path")
    return dirs


def slurm_node_dirs() -> tuple[str, ...]:
    """The slurm role's node directories, from its defaults (the munge key's: the directory that holds it)."""
    defaults = load_mapping(SLURM_ROLE_DEFAULTS)
    dirs = tuple(str(defaults[name]) for name in SLURM_DIR_VARS)
    if any("{{" in d or not d.startswith("/") for d in dirs):
        raise ValueError(f"{SLURM_ROLE_DEFAULTS}: {SLURM_DIR_VARS} must be absolute paths without templates: {dirs}")
    return (*dirs[:-1], str(Path(dirs[-1]).parent))


def slurm_spool_dir() -> str:
    """slurmd's spool on each node (the slurm role's slurm_spool_dir): its pid file, slurmd.pid, is there."""
    return dict(zip(SLURM_DIR_VARS, slurm_node_dirs(), strict=True))["slurm_spool_dir"]


def write_inventory_dir(
    path: Path, *, primaries: dict[str, dict], workers: dict[str, dict], cluster_vars: dict[str, Any]
) -> Path:
    """Write the inventory directory of `path` (inventory.yml's name): the hosts with their host variables,
    group_vars/all linked to the repository's, and `cluster_vars` as group_vars/cluster.yml."""
    inv_dir = Path(path).parent
    (inv_dir / "group_vars").mkdir(parents=True, exist_ok=True)
    link = inv_dir / "group_vars" / "all"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(REPO_GROUP_VARS)
    inventory = {
        "all": {"children": {"cluster": {"children": {"primary": {"hosts": primaries}, "workers": {"hosts": workers}}}}}
    }
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text("---\n# Test cluster inventory (tests/cluster/harness.py).\n" + yaml.safe_dump(inventory))
    tmp.replace(path)
    (inv_dir / "group_vars" / "cluster.yml").write_text(
        "---\n# What differs on the test cluster (tests/cluster/harness.py): the settings of\n"
        f"# {SETTINGS_FILE.relative_to(REPO)}, then this run's values.\n"
        + yaml.safe_dump(cluster_vars, sort_keys=False)
    )
    return Path(path)
