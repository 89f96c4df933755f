"""serve.yml on the test cluster, for the tests that serve a run (test_serve.py, test_finetune_zimage.py): the play
with the tests' server settings, the front's address and requests through it (HTTPS, trusting the CA the play
made in the cluster's state directory; an API key when the test gave serve_api_keys), and the serving processes in
each node's namespace (killed however a test ends)."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import signal
import ssl
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


def tls_dir(cluster: Cluster) -> Path:
    """Where serve.yml makes the front's private CA (ca.pem) in these tests: the cluster's state directory."""
    return cluster.state_dir / "serve-tls"


class Front:
    """The front's HTTPS address from this machine (the bridge reaches node1's address), trusting the CA serve.yml
    made; ``key``: the API key sent as ``Authorization: Bearer``; ``stats_tls``: serve.yml ran with a
    serve_stats_password, so the statistics page speaks TLS (on node1's loopback too, without the password)."""

    def __init__(self, cluster: Cluster, key: str | None = None, stats_tls: bool = False) -> None:
        self.cluster, self.key = cluster, key
        self.url = f"https://{cluster.address(1)}:8443"
        # read on node1 itself: its loopback needs no password (-k: the CA stays on this machine)
        self.stats_url = f"{'https' if stats_tls else 'http'}://127.0.0.1:8404/stats;csv"

    @property
    def ca(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(tls_dir(self.cluster) / "ca.pem"))

    def request(self, path: str, body: dict | None = None) -> urllib.request.Request:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        data = json.dumps(body).encode() if body is not None else None
        return urllib.request.Request(self.url + path, data, headers)

    def status(self, path: str, key: str | None, url: str | None = None) -> int:
        """The status of GET ``path`` with ``key`` (None: no Authorization header), at ``url`` (default the front)."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        req = urllib.request.Request((url or self.url) + path, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=60, context=self.ca) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.request(path), timeout=60, context=self.ca) as r:
            return json.loads(r.read())

    def image(self, model: str | None = None) -> tuple[int, Image.Image | str]:
        body = dict(BODY, **({"model": model} if model else {}))
        try:
            with urllib.request.urlopen(
                self.request("/v3/images/generations", body), timeout=120, context=self.ca
            ) as r:
                data = json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")[:300]
        except OSError as e:
            return 0, repr(e)
        return 200, Image.open(io.BytesIO(base64.b64decode(data["data"][0]["b64_json"])))

    def states(self) -> dict[str, str]:
        csv = self.cluster.ssh("node1", f"curl -skf '{self.stats_url}'", timeout=30).stdout
        return ansible_code("xeonsd_serve").haproxy_servers(csv, "xeonsd_serve")


def serve_play(cluster: Cluster, name: str, *args: str, timeout: float = 900) -> PlaybookRun:
    """serve.yml with the tests' server settings and ``args``; its rc checked (the failed tasks, else the log)."""
    tls = ("-e", f"serve_frontend_tls_dir={tls_dir(cluster)}")
    result = run_playbook(
        "serve.yml",
        cluster.inventory,
        *SERVE_SETTINGS,
        *tls,
        *args,
        state_dir=cluster.state_dir,
        name=name,
        timeout=timeout,
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
