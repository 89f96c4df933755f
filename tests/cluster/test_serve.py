"""serve.yml on the real 4-node test cluster: the LoRA run that test_finetune_methods.py trained (the lora_run fixture:
that run, or a small one of its own) served by `xeonsd serve` on every node behind HAProxy on node1. Requests through
the front get an image of the export's size; a node whose server is killed drops out of rotation while the others
answer; serve.yml brings it back (UP again, nothing changed on the other nodes); a new deployment rolls out two nodes
at a time (-e serve_serial=2) while a client keeps asking the front for the base, all answered: the recipe's textual
inversion run in the LoRA run's place and the LoRA run beside it as a second adapter, after which the concept answers
the openai client and the adapter answers; serve_state=stopped stops every server and the front. All of it with API
keys and TLS: the front answers only HTTPS (its certificate from the CA the play made), only with a key (but the
health checks), plain HTTP is refused, the statistics page wants its password, a node's server refuses another node's
address, and new keys reach the running servers by SIGHUP."""

from __future__ import annotations

import base64
import io
import json
import secrets
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from harness import Cluster
from jobs import controller_runs, wait_for
from PIL import Image
from runner import PlaybookRun
from serving import PID_FILE, Front, serve_play, serve_processes, servers_killed_after

SERVE_ARGS = ("-e", "serve_run=lora")  # the run test_finetune_methods.py trained
# The API keys and the statistics password, as a vault would give them: new ones each session; ROTATED replaces KEYS.
KEYS = [{"name": "ci", "key": secrets.token_urlsafe(24)}]
ROTATED = [{"name": "ci-next", "key": secrets.token_urlsafe(24)}]
STATS_PASSWORD = secrets.token_urlsafe(16)


def node_status(cluster: Cluster, src: str, node: int, key: str) -> str:
    """The status of GET /v1/models on node ``node``'s server itself, asked from ``src`` with ``key``."""
    url = f"http://{cluster.address(node)}:8000/v1/models"
    curl = f"curl -s -o /dev/null -w '%{{http_code}}' -H 'Authorization: Bearer {key}' {url}"
    return cluster.ssh(src, curl, check=False, timeout=60).stdout.strip()


def check_the_front_is_the_only_way_in(cluster: Cluster, front: Front) -> None:
    """HTTPS with the key through the front; nothing without it (but the health checks); no plain HTTP; the
    statistics page wants its password from elsewhere; a node's server refuses another node's address."""
    assert front.status("/v1/models", front.key) == 200
    assert [front.status(p, k) for p, k in [("/v1/models", None), ("/v1/models", "x" * 32), ("/metrics", None)]] == [
        401
    ] * 3
    assert front.status("/v2/health/ready", None) == 200  # what HAProxy's health check asks, keys or not
    with pytest.raises(urllib.error.URLError) as plain:
        urllib.request.urlopen(f"http://{cluster.address(1)}:8080/v1/models", timeout=10)
    assert isinstance(plain.value.reason, ConnectionRefusedError), plain.value  # serve_http: refuse
    stats = f"https://{cluster.address(1)}:8404"
    assert front.status("/stats;csv", None, url=stats) == 401
    login = base64.b64encode(f"xeonsd:{STATS_PASSWORD}".encode()).decode()
    req = urllib.request.Request(stats + "/stats;csv", headers={"Authorization": f"Basic {login}"})
    with urllib.request.urlopen(req, timeout=30, context=front.ca) as r:
        assert "xeonsd_serve" in r.read().decode()
    # node3's server: the front's address (node1) gets in, another node's (node2) is refused (--allow-from).
    assert node_status(cluster, "node1", 3, front.key) == "200"
    assert node_status(cluster, "node2", 3, front.key) == "403"


class Client(threading.Thread):
    """Asks the front for images one after another until stopped; every answer's status is kept."""

    def __init__(self, front: Front) -> None:
        super().__init__(daemon=True)
        self.front, self.codes, self.errors, self.stop = front, [], [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            code, answer = self.front.image()  # the base: every node has one, before and after a roll-out
            self.codes.append(code)
            if code != 200:
                self.errors.append((code, answer))


def check_the_concept_is_served(play: PlaybookRun, front: Front, run: Path) -> None:
    """serve.yml serves a textual inversion run: its name is the base's, its token is listed, and through the
    ``openai`` client a prompt with the token makes another image than the same prompt with the word it started
    from (the token is the learned vector, not text)."""
    import httpx
    import openai

    summary = json.loads((run / "train_summary.json").read_text())
    token = summary["placeholder_tokens"][0]
    rows = front.get("/v1/models")["data"]
    assert rows[0]["id"] == run.name and token in json.dumps(rows[0]["concept_tokens"]), rows
    api = openai.OpenAI(
        base_url=f"{front.url}/v1", api_key=front.key, http_client=httpx.Client(verify=front.ca), max_retries=0
    )

    def image(prompt: str) -> np.ndarray:
        data = api.images.generate(model=run.name, prompt=prompt, extra_body={"rng_seed": 1, "num_inference_steps": 2})
        return np.asarray(Image.open(io.BytesIO(base64.b64decode(data.data[0].b64_json))).convert("RGB"), np.float64)

    concept, word = image(f"a photo of a {token}"), image("a photo of a toy")
    moved = float(np.abs(concept - word).mean())
    print(f"\nserve.yml, textual inversion run {run.name}: {token} moves the image {moved:.2f} on average ({play.log})")
    assert moved > 0.0


def test_serve_yml_behind_one_front_survives_a_killed_node_and_rolls_out_a_second_adapter(
    provisioned: Cluster, lora_run: Path, base_export_run: Path
) -> None:
    runs = controller_runs(provisioned)
    shape = json.loads((runs / "lora" / "openvino" / "xeonsd_export.json").read_text())["static_shape"]
    front = Front(provisioned, key=KEYS[0]["key"], stats_tls=True)

    def serve(name: str, *args: str, keys: list[dict] = KEYS) -> PlaybookRun:
        security = json.dumps({"serve_api_keys": keys, "serve_stats_password": STATS_PASSWORD})
        return serve_play(provisioned, name, *SERVE_ARGS, "-e", security, *args)

    with servers_killed_after(provisioned):
        serve("serve")
        assert front.states() == dict.fromkeys(provisioned.nodes, "UP")
        check_the_front_is_the_only_way_in(provisioned, front)
        models = [m["id"] for m in front.get("/v1/models")["data"]]
        assert models == ["tiny-sd", "lora"], models  # the base model's name, the run's adapter by the run's name
        code, image = front.image("lora")
        assert code == 200, image
        assert image.size == (shape["width"], shape["height"]), (image.size, shape)

        # node3's server killed: the front takes it out of rotation, the others keep answering.
        provisioned.ssh("node3", f"kill -9 $(head -1 {PID_FILE})")
        answers = [front.image()[0] for _ in range(4)]
        wait_for(lambda: front.states().get("node3", "").startswith("DOWN"), 30, "the front to mark node3 DOWN")
        assert answers == [200] * 4, answers
        assert front.image()[0] == 200

        # serve.yml again, with the keys rotated, brings node3 back into rotation; on the other nodes it changes the
        # key file alone and reloads it by SIGHUP (the key file, the signal): the same servers answer the new key.
        running = {n: pids for n, pids in serve_processes(provisioned).items() if n != "node3"}
        back = serve("serve-again", keys=ROTATED)
        assert front.states() == dict.fromkeys(provisioned.nodes, "UP")
        changed = back.changed()
        assert changed["node3"] >= 1 and {n: c for n, c in changed.items() if n != "node3"} == dict.fromkeys(
            ["node1", "node2", "node4"], 2
        ), changed
        assert {n: pids for n, pids in serve_processes(provisioned).items() if n != "node3"} == running
        old, front.key = front.key, ROTATED[0]["key"]
        for node in range(1, 5):
            wait_for(lambda n=node: node_status(provisioned, "node1", n, front.key) == "200", 20, f"node{node}'s key")
            assert node_status(provisioned, "node1", node, old) == "401"

        # A new deployment rolled out two nodes at a time (serve_serial=2: the batches and their waits are the
        # default's code, one node at a time, with half the restarts' wall; the client's requests during the rollout
        # are CPU on 2 cores) while a client keeps asking the front for the base: the
        # recipe's own run, textual inversion (test_finetune_e2e.py's "e2e"), in the LoRA run's place (the base export
        # with the learned concept, under the run's name), and the LoRA run beside it as a second adapter.
        client = Client(front)
        client.start()
        try:
            wait_for(lambda: len(client.codes) >= 1, 120, "the client's first answer")
            second = json.dumps({"serve_adapters": {"second": {"run": "lora", "alpha": 0.5}}})
            rollout = ("-e", "serve_run=e2e", "-e", "serve_serial=2", "-e", second)
            play = serve("serve-concept-second-adapter", *rollout, keys=ROTATED)
        finally:
            client.stop.set()
            client.join(timeout=180)
        assert client.errors == [] and len(client.codes) >= 2, client.errors
        models = [m["id"] for m in front.get("/v1/models")["data"]]
        assert models == [base_export_run.name, "second"], models
        code, image = front.image("second")
        assert code == 200 and image.size == (shape["width"], shape["height"]), image
        check_the_concept_is_served(play, front, base_export_run)

        serve("serve-stopped", "-e", "serve_state=stopped")
        assert serve_processes(provisioned) == {}
        with pytest.raises(urllib.error.URLError) as stopped:
            urllib.request.urlopen(front.url + "/v2/health/live", timeout=5, context=front.ca)
        assert isinstance(stopped.value.reason, ConnectionRefusedError), stopped.value
