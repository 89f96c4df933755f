"""ranks_per_node and mpi_ranks as numbers, with ``auto`` read from the tuning result on the controller.

``ranks_per_node: auto`` (cluster.yml) is the best layout that ``ansible-playbook doctor.yml -e tune_layout=true``
measured on one node and stored on the controller (``runs/layout.json``); ``mpi_ranks: auto`` is the nodes × the
ranks per node. The result's schema, its checks and the messages ("Fix: run … doctor.yml -e tune_layout=true") are
xeonsd's: train/src/xeonsd/contracts/layout_result.py (standard library only), which this plugin imports from the controller's venv.

    finetune_ranks_per_node: "{{ ranks_per_node | xeonsd_ranks_per_node(layout_file) }}"
    finetune_ranks: "{{ mpi_ranks | xeonsd_mpi_ranks(groups['cluster'], finetune_ranks_per_node) }}"
    "{{ doctor_layout | xeonsd_layout_lines }}": the lines the play prints (one per layout, then the best)
    "{{ layout_file | xeonsd_layout_stale(finetune_train_argv) }}": a warning when the result was measured for
        other training arguments (method, resolution, batch, model), else ""
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

# xeonsd's standard-library-only parts, from the controller's venv (`make install`: see plugins/README.md).
from xeonsd.contracts import layout_result as result_rules

LayoutError = result_rules.LayoutError
ranks_per_node = result_rules.resolve_ranks_per_node  # value, layout_file, missing: see its docstring


def mpi_ranks(value: object, nodes: Sequence[str], per_node: object) -> int:
    """``value`` as a number; ``auto``: len(``nodes``) × ``per_node``."""
    if isinstance(nodes, str) or not isinstance(nodes, Sequence):
        raise TypeError(f"xeonsd_mpi_ranks: nodes must be a list of hosts, got {nodes!r}")
    return result_rules.resolve_mpi_ranks(value, len(nodes), int(per_node))


def layout_result(stdout_lines: Sequence[str]) -> dict:
    """The tuning result that ``xeonsd bench layout --json`` printed as its last JSON line, checked."""
    found = [line for line in stdout_lines or [] if line.startswith("{")]
    if not found:
        raise LayoutError("xeonsd bench layout printed no result")
    return result_rules.check(json.loads(found[-1]), "xeonsd bench layout's output")


def layout_lines(result: Mapping) -> list[str]:
    return result_rules.result_lines(result_rules.check(dict(result)))


def layout_stale(layout_file: str, train_argv: Sequence[str]) -> str:
    """The warning for a job whose ``ranks_per_node: auto`` reads a result measured with other arguments, or ""."""
    if isinstance(train_argv, str) or not isinstance(train_argv, Sequence):
        raise TypeError(f"xeonsd_layout_stale: train_argv must be a list of arguments, got {train_argv!r}")
    return result_rules.stale_warning(layout_file, list(train_argv))


class FilterModule:
    def filters(self) -> dict:
        return {
            "xeonsd_ranks_per_node": ranks_per_node,
            "xeonsd_mpi_ranks": mpi_ranks,
            "xeonsd_layout_result": layout_result,
            "xeonsd_layout_lines": layout_lines,
            "xeonsd_layout_stale": layout_stale,
        }
