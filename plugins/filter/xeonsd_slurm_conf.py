"""xeonsd_slurm_nodes and xeonsd_slurm_conf: the slurm.conf that the slurm role (slurm_install: true) writes on
every node, generated from the inventory.

``hostvars | xeonsd_slurm_nodes(hosts)`` gives each host's Slurm node: its ``slurm_node_name``, its address on the
MPI network (``mpi_address``), its CPUs and memory (``slurm_node_cpus`` / ``slurm_node_memory_mb`` when the
inventory sets them, else the host's gathered facts, the fact cache's with ``--limit``: ``processor_vcpus`` and
``memtotal_mb`` less ``memory_reserve_mb``). ``xeonsd_slurm_conf`` renders the file: the controller on the
primary, one ``NodeName`` line per node, one partition of all of them (the default), the plugins and directories
of the role's variables, and the site's own lines last. Every value is checked: a wrong one raises ValueError
naming it and the fix, so the play stops before a slurmctld that would refuse its configuration.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

# A Slurm name (cluster, node, partition): letters, digits, _ . - (ClusterName also must be lower case for slurmdbd).
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
# A slurm.conf value: no spaces (one key=value per line), no comment sign, no newline.
_VALUE = re.compile(r"^[^\s#]+$")
CONF_REQUIRED = ("cluster_name", "controller", "nodes", "partition", "settings")


def _fail(message: str) -> None:
    raise ValueError(f"xeonsd_slurm_conf: {message}")


def _name(value: object, what: str) -> str:
    text = str(value)
    if not _NAME.match(text):
        _fail(f"{what} {text!r} is not a Slurm name (letters, digits, _ . - only). Fix: rename it in the inventory.")
    return text


def _count(value: object, what: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        _fail(f"{what} must be a positive integer, got {value!r}")
    return number


def _fact(host: str, hv: Mapping, var: str, fact: str) -> object:
    """The inventory's ``var`` of the host, else its gathered ``fact``; a clear error when neither is known."""
    value = hv.get(var)
    if value not in (None, ""):
        return value
    facts = hv.get("ansible_facts") or {}
    if fact in facts:
        return facts[fact]
    _fail(
        f"{host} has no {var} and no gathered {fact} (its facts were not gathered in this run nor cached). "
        f"Fix: run provision.yml once without --limit, or set {var} for {host} in the inventory."
    )
    return None  # unreachable: _fail raises


def slurm_nodes(hostvars: Mapping, hosts: Sequence[str], memory_reserve_mb: int = 0) -> list[dict]:
    """[{name, address, cpus, memory_mb}] of ``hosts`` in their order, from their host variables (see above)."""
    if isinstance(hosts, str) or not hosts:
        _fail(f"hosts must be a non-empty list of inventory names, got {hosts!r}")
    nodes = []
    for host in hosts:
        hv = hostvars[host]
        memory = _fact(host, hv, "slurm_node_memory_mb", "memtotal_mb")
        reserve = 0 if hv.get("slurm_node_memory_mb") not in (None, "") else int(memory_reserve_mb)
        nodes.append(
            {
                "name": str(hv.get("slurm_node_name") or host),
                "address": str(hv.get("mpi_address") or hv.get("ansible_host") or host),
                "cpus": _count(_fact(host, hv, "slurm_node_cpus", "processor_vcpus"), f"the CPUs of {host}"),
                "memory_mb": _count(int(memory) - reserve, f"the memory (MB) of {host} less the reserve"),
            }
        )
    return nodes


def _setting(key: object, value: object) -> str:
    if not _NAME.match(str(key)):
        _fail(f"setting name {key!r} is not a slurm.conf key")
    text = str(value).lower() if isinstance(value, bool) else str(value)
    if not _VALUE.match(text):
        _fail(f"{key}={text!r}: a slurm.conf value has no spaces or '#'. Fix: correct it in slurm_settings.")
    return f"{key}={text}"


def slurm_conf(conf: Mapping) -> str:
    """The whole slurm.conf of ``conf``: cluster_name, controller ({name, address}: the primary's host name, which
    slurmctld compares with its own, and its address), nodes
    (xeonsd_slurm_nodes), partition, settings (key → value, in order) and extra_lines (the site's own, last)."""
    missing = [k for k in CONF_REQUIRED if k not in conf]
    if missing:
        _fail(f"missing {', '.join(missing)}")
    nodes = conf["nodes"]
    if isinstance(nodes, str) or not isinstance(nodes, Sequence) or not nodes:
        _fail(f"nodes must be a non-empty list of nodes, got {nodes!r}")
    names = [_name(n["name"], "node name") for n in nodes]
    if len(set(names)) != len(names):
        _fail(f"two hosts have the same Slurm name in {names}. Fix: give each host its own slurm_node_name.")
    controller = conf["controller"]
    _name(controller["name"], "controller host name")
    cluster = _name(conf["cluster_name"], "cluster name")
    if cluster != cluster.lower():
        _fail(f"cluster name {cluster!r} must be lower case (slurmdbd compares it so). Fix: set slurm_cluster_name.")
    lines = [
        "# slurm.conf generated from the inventory by the slurm role (plugins/filter/xeonsd_slurm_conf.py).",
        "# The same file on every node; edit the inventory, not this file.",
        f"ClusterName={cluster}",
        f"SlurmctldHost={controller['name']}({_value(controller['address'], 'controller address')})",
    ]
    lines += [_setting(k, v) for k, v in dict(conf["settings"]).items()]
    for node in nodes:
        lines.append(
            f"NodeName={node['name']} NodeAddr={_value(node['address'], 'address of ' + node['name'])} "
            f"CPUs={_count(node['cpus'], 'CPUs of ' + node['name'])} "
            f"RealMemory={_count(node['memory_mb'], 'memory of ' + node['name'])} State=UNKNOWN"
        )
    partition = _name(conf["partition"], "partition")
    lines.append(f"PartitionName={partition} Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP")
    extra = conf.get("extra_lines") or []
    if isinstance(extra, str):
        _fail("extra_lines must be a list of lines, got a string. Fix: make slurm_conf_extra_lines a YAML list.")
    for line in map(str, extra):
        if "\n" in line:
            _fail(f"extra line {line!r}: one line each. Fix: split it into items of slurm_conf_extra_lines.")
        lines.append(line)
    return "\n".join(lines) + "\n"


def _value(value: object, what: str) -> str:
    text = str(value)
    if not _VALUE.match(text):
        _fail(f"{what} {text!r} has spaces or '#'")
    return text


class FilterModule:
    def filters(self) -> dict:
        return {"xeonsd_slurm_nodes": slurm_nodes, "xeonsd_slurm_conf": slurm_conf}
