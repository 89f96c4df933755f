"""serve.yml on the real 4-node test cluster: the LoRA run that test_finetune_methods.py trained (the lora_run
fixture: that run, or a small one of its own) served by `xeonsd serve` on every node behind HAProxy on node1. Requests
through the front get an image of the export's size; a node whose server is killed drops out of rotation while
the others answer; serve.yml brings it back (UP again, nothing changed on the other nodes); a second adapter rolls
out one node at a time while a client keeps asking the front, and both adapters answer; serve_state=stopped stops
every server and the front."""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path

import pytest
from harness import Cluster
from jobs import controller_runs, wait_for
from runner import PlaybookRun
from serving import PID_FILE, Front, serve_play, serve_processes, servers_killed_after

SERVE_ARGS = ("-e", "serve_run=lora")  # the run test_finetune_methods.py trained


class Client(threading.Thread):
    """Asks the front for images one after another until stopped; every answer's status is kept."""

    def __init__(self, front: Front) -> None:
        super().__init__(daemon=True)
        self.front, self.codes, self.errors, self.stop = front, [], [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            code, answer = self.front.image("lora" if len(self.codes) % 2 else None)  # models every node has
            self.codes.append(code)
            if code != 200:
                self.errors.append((code, answer))


def test_serve_yml_behind_one_front_survives_a_killed_node_and_rolls_out_a_second_adapter(
    provisioned: Cluster, lora_run: Path
) -> None:
    runs = controller_runs(provisioned)
    shape = json.loads((runs / "lora" / "openvino" / "xeonsd_export.json").read_text())["static_shape"]
    front = Front(provisioned)

    def serve(name: str, *args: str) -> PlaybookRun:
        return serve_play(provisioned, name, *SERVE_ARGS, *args)

    with servers_killed_after(provisioned):
        serve("serve")
        assert front.states() == dict.fromkeys(provisioned.nodes, "UP")
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

        # serve.yml again brings node3 back into rotation and changes nothing on the other nodes.
        back = serve("serve-again")
        assert front.states() == dict.fromkeys(provisioned.nodes, "UP")
        changed = back.changed()
        assert changed["node3"] >= 1 and {n: c for n, c in changed.items() if n != "node3"} == dict.fromkeys(
            ["node1", "node2", "node4"], 0
        ), changed

        # A second adapter, rolled out one node at a time while a client keeps asking the front.
        client = Client(front)
        client.start()
        try:
            wait_for(lambda: len(client.codes) >= 1, 120, "the client's first answer")
            serve(
                "serve-second-adapter", "-e", json.dumps({"serve_adapters": {"second": {"run": "lora", "alpha": 0.5}}})
            )
        finally:
            client.stop.set()
            client.join(timeout=180)
        assert client.errors == [] and len(client.codes) >= 2, client.errors
        models = [m["id"] for m in front.get("/v1/models")["data"]]
        assert models == ["tiny-sd", "lora", "second"], models
        for model in ("lora", "second"):
            code, image = front.image(model)
            assert code == 200 and image.size == (shape["width"], shape["height"]), (model, image)

        serve("serve-stopped", "-e", "serve_state=stopped")
        assert serve_processes(provisioned) == {}
        with pytest.raises(OSError):
            urllib.request.urlopen(front.url + "/v2/health/live", timeout=5)
