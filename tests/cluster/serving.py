"""serve.yml on the test cluster, for the tests that serve a run (test_serve.py, test_finetune_zimage.py): the play
with the tests' server settings, the front's address and requests through it, and the serving processes in each
node's namespace (killed however a test ends)."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from harness import Cluster
from PIL import Image
from repo_code import ansible_code
from runner import PlaybookRun, run_playbook

# The servers' settings in these tests: one worker per node (4 nodes share 2 cores), a generous timeout.
SERVE_SETTINGS = ("-e", "serve_workers=1", "-e", "serve_timeout=120")
PID_FILE = "/var/cache/xeonsd/serve/serve.pid"  # serve_state_dir on the test cluster (group_vars/cluster.yml)
BODY = {
    "prompt": "a yellow robot at the beach",
    "n": 1,
    "num_inference_steps": 2,
    "rng_seed": 7,
    "response_format": "b64_json",
}


def serve_processes(cluster: Cluster) -> dict[str, list[int]]:
    """{node: PIDs of xeonsd serve and HAProxy} in each node's network namespace."""
    found: dict[str, list[int]] = {}
    for node in cluster.nodes:
        pids = subprocess.run(["ip", "netns", "pids", f"{cluster.prefix}-{node}"], capture_output=True, text=True)
        for pid in pids.stdout.split():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if (b"serve" in cmd and any(a.endswith(b"xeonsd") for a in cmd)) or cmd[0].endswith(b"haproxy"):
                found.setdefault(node, []).append(int(pid))
    return found


class Front:
    """The front's address from this machine (the bridge reaches node1's address)."""

    def __init__(self, cluster: Cluster) -> None:
        self.url = f"http://{cluster.address(1)}:8080"
        self.stats_url = f"http://{cluster.address(1)}:8404/stats;csv"

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=60) as r:
            return json.loads(r.read())

    def image(self, model: str | None = None) -> tuple[int, Image.Image | str]:
        body = dict(BODY, **({"model": model} if model else {}))
        req = urllib.request.Request(
            self.url + "/v3/images/generations", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                data = json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")[:300]
        except OSError as e:
            return 0, repr(e)
        return 200, Image.open(io.BytesIO(base64.b64decode(data["data"][0]["b64_json"])))

    def states(self) -> dict[str, str]:
        with urllib.request.urlopen(self.stats_url, timeout=10) as r:
            return ansible_code("xeonsd_serve").haproxy_servers(r.read().decode(), "xeonsd_serve")


def serve_play(cluster: Cluster, name: str, *args: str, timeout: float = 900) -> PlaybookRun:
    """serve.yml with the tests' server settings and ``args``; its rc checked (the failed tasks, else the log)."""
    result = run_playbook(
        "serve.yml", cluster.inventory, *SERVE_SETTINGS, *args, state_dir=cluster.state_dir, name=name, timeout=timeout
    )
    assert result.rc == 0, "\n".join(map(str, result.failures())) or result.tail(60)
    return result


@contextlib.contextmanager
def servers_killed_after(cluster: Cluster) -> Iterator[None]:
    """However the block ends, no xeonsd serve or HAProxy is left on a node (SIGKILL to what is)."""
    try:
        yield
    finally:
        for pids in serve_processes(cluster).values():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
