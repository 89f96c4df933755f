#!/usr/bin/python
"""Ansible module: TCP ports of several hosts probed at once from where the task runs (one module run instead of a
``wait_for`` per host): preflight's SSH probe from the controller and the MPI network probe between the nodes.
Each target is retried until it accepts a connection or its timeout passes, all targets in parallel; the module
reports what it found and never fails on an unreachable target (the caller's assert names them and the fix).
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: xeonsd_tcp_probe
short_description: Probe the TCP ports of several hosts at once
description:
  - Connects to every C(targets) item's C(host):C(port), retrying until it answers or C(timeout) seconds pass,
    all targets in parallel. Returns C(results), one per target in order, C({name, host, port, ok, msg}).
    Changes nothing; check mode runs it too.
options:
  targets:
    description: Each C({name, host, port}); C(name) names the target in the results (an inventory host).
    type: list
    elements: dict
    required: true
  timeout:
    description: Seconds to keep trying each target.
    type: float
    default: 5
"""


def probe(target: dict, timeout: float) -> dict:
    """``target`` with ``ok`` (it accepted a TCP connection before ``timeout`` seconds) and ``msg``."""
    host, port = str(target["host"]), int(target["port"])
    deadline = time.monotonic() + timeout
    error = "no answer"
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(left, 0.1)):
                return {**target, "port": port, "ok": True, "msg": f"{host}:{port} answered"}
        except OSError as e:
            error = e.strerror or str(e)
        if deadline - time.monotonic() <= 0:
            return {**target, "port": port, "ok": False, "msg": f"Timeout when waiting for {host}:{port} ({error})"}
        time.sleep(min(0.5, max(deadline - time.monotonic(), 0)))


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "targets": {"type": "list", "elements": "dict", "required": True},
            "timeout": {"type": "float", "default": 5},
        },
        supports_check_mode=True,
    )
    targets = module.params["targets"]
    for t in targets:
        if not all(k in t for k in ("name", "host", "port")):
            module.fail_json(msg=f"xeonsd_tcp_probe: every target needs name, host and port; got {t}")
    with ThreadPoolExecutor(max_workers=max(1, min(len(targets), 64))) as pool:
        results = list(pool.map(lambda t: probe(t, module.params["timeout"]), targets))
    module.exit_json(changed=False, results=results)


if __name__ == "__main__":
    main()
