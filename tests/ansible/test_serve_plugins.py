"""serve.yml's Ansible code: the filter that reads HAProxy's CSV statistics and lists the files a node must copy,
and the xeonsd_daemon module (ansible-playbook, local connection) that keeps a process by a pid file checked to be
ours: started once, left alone while current, restarted when outdated, a pid file naming someone else's process
never signalled."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from repo_code import ansible_code, changed, local_playbook

serve = ansible_code("xeonsd_serve")

# HAProxy 2.6's ;csv header (as the serve_frontend role's stats page gives it), and rows with the fields the filter
# reads: one node UP, one DOWN after its server was killed, one in maintenance, then the backend's own line.
HEADER = (
    "# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,wredis,status,weight,"
    "act,bck,chkfail,chkdown,lastchg,downtime,qlimit,pid,iid,sid,throttle,lbtot,tracked,type,rate,rate_lim,rate_max,"
    "check_status,check_code,check_duration"
)


def row(px: str, sv: str, status: str) -> str:
    return ",".join([px, sv] + [""] * 15 + [status] + [""] * 21)


def test_haproxy_statistics_give_each_node_state_of_the_backend_only() -> None:
    csv = (
        "\n".join(
            [
                HEADER,
                row("xeonsd_serve_front", "FRONTEND", "OPEN"),
                row("xeonsd_serve", "node1", "UP"),
                row("xeonsd_serve", "node2", "DOWN"),
                row("xeonsd_serve", "node3", "MAINT"),
                row("xeonsd_serve", "BACKEND", "UP"),
                row("other", "node9", "UP"),
            ]
        )
        + "\n"
    )
    assert serve.haproxy_servers(csv, "xeonsd_serve") == {"node1": "UP", "node2": "DOWN", "node3": "MAINT"}
    try:
        serve.haproxy_servers("<html>503 Service Unavailable</html>", "xeonsd_serve")
    except ValueError as e:
        assert "not HAProxy's CSV statistics" in str(e)
    else:
        raise AssertionError("a page that is not the CSV statistics was read as one")


def _slurped(path: str, summary: dict) -> dict:
    """One item of the serve role's slurp loop over the runs' train_summary.json."""
    content = base64.b64encode(json.dumps(summary).encode()).decode()
    return {"item": {"item": path, "stat": {}}, "content": content}


def test_the_plan_asks_the_run_s_family_whether_its_lora_is_an_adapter_or_fused() -> None:
    """A FLUX.2 [klein] LoRA run is registered as an adapter on the base export; a Z-Image one (GenAI applies no
    adapters to it) serves its own fused export alone; a family this xeonsd does not know is refused by name."""
    lora = {"method": "lora", "base_model": "/m/b", "base_model_fingerprint": "f", "result": {"path": "a.safetensors"}}
    plan = serve.serve_plan_of([_slurped("/r/k", {**lora, "family": "flux2"})], [], "/r/k/openvino")
    assert [a["name"] for a in plan["adapters"]] == ["k"] and plan["name"] == "b"
    plan = serve.serve_plan_of([_slurped("/r/z", {**lora, "family": "zimage"})], [], "/r/z/openvino")
    assert (plan["adapters"], plan["name"]) == ([], "z")
    with pytest.raises(serve.ServePlanError, match="/r/x/train_summary.json: .*wan"):
        serve.serve_plan_of([_slurped("/r/x", {**lora, "family": "wan"})], [], "/r/x/openvino")
    # no OpenVINO export for the family: the base model's pipeline on the PyTorch engine, the adapter registered
    plan = serve.serve_plan_of([_slurped("/r/q", {**lora, "family": "qwenimage_edit"})], [], "")
    assert (plan["export"], plan["engine"], [a["name"] for a in plan["adapters"]]) == ("/m/b", "torch", ["q"])


def _index(cls: str | None) -> dict:
    """The serve role's slurp of a pipeline's model_index.json (None: the file is not there)."""
    if cls is None:
        return {"failed": True, "msg": "file not found"}
    return {"content": base64.b64encode(json.dumps({"_class_name": cls}).encode()).decode()}


def test_a_krea2_raw_lora_is_served_on_turbo_and_a_pipeline_of_another_family_is_refused_naming_both() -> None:
    """serve_inference_model (or the run's own inference_model, the Turbo it validated on) replaces the base model
    of a torch-engine run; a pipeline of another family, one without model_index.json, a relative path, and the
    variable where it does not apply (an export family, a full fine-tune) are refused, each naming the fix."""
    lora = {"method": "lora", "base_model": "/m/raw", "base_model_fingerprint": "f", "result": {"path": "a.st"}}
    krea = [_slurped("/r/k", {**lora, "family": "krea2"})]
    assert serve.serve_plan_of(krea, [], "")["export"] == "/m/raw"  # nothing named: its base model
    plan = serve.serve_plan_of(krea, [], "", inference_model="/m/turbo", inference_index=_index("Krea2Pipeline"))
    assert (plan["export"], plan["engine"], [a["name"] for a in plan["adapters"]]) == ("/m/turbo", "torch", ["k"])
    own = [_slurped("/r/k", {**lora, "family": "krea2", "inference_model": "/m/turbo/"})]
    # the path plan.yml reads model_index.json in: serve_inference_model, else the run's own, else none
    assert [serve.inference_model_of(r, given) for r, given in ((own, "/m/t2"), (own, ""), (krea, ""))] == [
        "/m/t2",
        "/m/turbo/",
        "",
    ]
    assert serve.serve_plan_of(own, [], "", inference_index=_index("Krea2Pipeline"))["export"] == "/m/turbo"
    refusals = [
        (krea, "/m/flux", _index("FluxPipeline"), r"/m/flux is a FLUX\.1 pipeline \(FluxPipeline\), and serve_run /r/k "
         r"is a Krea 2 run.*Fix: name a Krea 2 pipeline"),
        (krea, "/m/none", _index(None), "/m/none holds no model_index.json on the primary"),
        (krea, "turbo", _index("Krea2Pipeline"), "'turbo' is no absolute path"),
        ([_slurped("/r/s", {**lora, "family": "sd"})], "/m/t", _index("StableDiffusionPipeline"),
         "serve_run /r/s is served from its OpenVINO export"),
        ([_slurped("/r/f", {**lora, "method": "full", "family": "krea2", "result": {"path": "model_index.json"}})],
         "/m/turbo", _index("Krea2Pipeline"), "serve_run /r/f is a full fine-tune"),
    ]  # fmt: skip
    for runs, path, index, words in refusals:
        with pytest.raises(serve.ServePlanError, match=words):
            serve.serve_plan_of(runs, [], "/r/s/openvino", inference_model=path, inference_index=index)


def test_a_textual_inversion_run_is_planned_with_its_embeddings_as_a_file_every_node_needs() -> None:
    """What the serve role hands on for an SDXL textual inversion run: the base model's export, the run's concept as
    --embeds (and its token), the embeddings among the files pushed to each node, the run's name for the base."""
    ti = {
        "method": "textual_inversion",
        "base_model": "/m/b",
        "base_model_fingerprint": "f",
        "result": {"path": "learned_embeds.safetensors"},
        "placeholder_tokens": ["<c>"],
        "family": "sdxl",
    }
    plan = serve.serve_plan_of([_slurped("/r/t", ti)], [], "/h/openvino-base/f")
    assert (plan["name"], plan["files"]) == ("t", ["/r/t/learned_embeds.safetensors"])
    argv = serve.serve_argv(plan, {"port": 8000})
    assert argv == ["serve", "/h/openvino-base/f", "--embeds", "/r/t/learned_embeds.safetensors", "--token", "<c>",
                    "--name", "t", "--port", "8000"]  # fmt: skip


def test_serve_blends_become_blend_flags_and_a_blend_of_an_unserved_adapter_says_what_to_fix() -> None:
    """serve_blends: each a --blend in its normal form (parts by name), checked by xeonsd serve's own parser against
    the served adapters (serve_run's LoRA k at serve_lora_alpha 0.8, serve_adapters' s at 1) on the controller."""
    lora = {"method": "lora", "base_model": "/m/b", "base_model_fingerprint": "f", "result": {"path": "a.safetensors"}}
    runs = [_slurped("/r/k", {**lora, "family": "sd"}), _slurped("/r/s", {**lora, "family": "sd"})]
    blends = ["@s:0.3+@k:0.7", "@k:0.5"]
    plan = serve.serve_plan_of(runs, [{"name": "s", "alpha": 1.0}], "/r/k/openvino", 0.8, blends)
    argv = serve.serve_argv(plan, {"port": 8000})
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--blend"] == ["@k:0.7+@s:0.3", "@k:0.5"], argv
    assert serve.serve_argv(serve.serve_plan_of(runs, [{"name": "s", "alpha": 1.0}], "/r/k/openvino"), {})[2:4] == [
        "--adapter",
        "k=/r/k/a.safetensors:1",
    ]  # no serve_blends: no --blend
    for bad, words in (
        (["@k:0.7+@nope:0.3"], "no adapter 'nope'; registered: k, s"),
        (["@k:0.8"], "one adapter at its own --adapter alpha"),
        (["@k:0.5", "@k:0.50"], "declared twice"),
        ("@k:0.5", "it is a list of LoRA blends"),
    ):
        with pytest.raises(serve.ServePlanError, match="serve_blends") as caught:
            serve.serve_plan_of(runs, [{"name": "s", "alpha": 1.0}], "/r/k/openvino", 0.8, bad)
        assert words in str(caught.value) and "Fix:" in str(caught.value), caught.value


def test_a_node_pulls_the_files_it_lacks_or_holds_changed() -> None:
    found = [{"path": "/e/unet.xml", "checksum": "a"}, {"path": "/e/unet.bin", "checksum": "b"}]
    stats = [{"stat": {"exists": True, "path": "/r/l.safetensors", "checksum": "c"}}, {"stat": {"exists": False}}]
    expected = {"/e/unet.xml": "a", "/e/unet.bin": "B", "/r/l.safetensors": "c", "/r/m.safetensors": "d"}
    node = serve.serve_files(found, stats)
    assert node == {"/e/unet.bin": "b", "/e/unet.xml": "a", "/r/l.safetensors": "c"}
    assert serve.serve_files_to_pull(node, expected) == ["/e/unet.bin", "/r/m.safetensors"]
    assert serve.serve_files_to_pull(expected, expected) == []


PLAY = """
- hosts: localhost
  gather_facts: false
  tasks:
    - xeonsd.cluster.xeonsd_daemon:
        state: "{{ item.state }}"
        argv: "{{ item.argv | default(argv) }}"
        match: ["--port", "18999"]
        version: "{{ item.version | default('') }}"
        pid_file: "{{ pid_file }}"
        log: "{{ log }}"
        settle: 0.5
        stop_timeout: 5
      loop: "{{ steps }}"
      register: daemon
    - ansible.builtin.copy: {dest: "{{ out }}", content: "{{ daemon.results | to_json }}", mode: "0644"}
      check_mode: false
      changed_when: false
"""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_daemon_module_keeps_one_current_process_of_ours_and_never_signals_another(tmp_path: Path) -> None:
    """One process of ours (the words --port 18999 on its command line, as the serve role matches its server):
    started, left alone while current, restarted when outdated, stopped; a pid file naming another process is
    removed without a signal; a command that ends at once fails with its log."""
    (tmp_path / "play.yml").write_text(PLAY)
    out, pid_file = tmp_path / "out.json", tmp_path / "d.pid"
    argv = [sys.executable, "-c", "import time; time.sleep(600)", "--port", "18999"]
    base = {
        "argv": argv,
        "pid_file": str(pid_file),
        "log": str(tmp_path / "d.log"),
        "out": str(out),
        "ansible_python_interpreter": sys.executable,
    }

    def run(*steps: dict) -> list[dict]:
        local = local_playbook(tmp_path / "play.yml", base | {"steps": list(steps)})
        assert local.returncode == 0, local.stdout[-3000:]
        return json.loads(out.read_text())

    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    started: list[int] = []
    try:
        first, again, status, restart, stop = run(
            {"state": "started", "version": "v1"},
            {"state": "started", "version": "v1"},
            {"state": "status", "version": "v2"},
            {"state": "started", "version": "v2"},
            {"state": "stopped"},
        )
        started = [first["pid"], restart["pid"]]
        assert first["changed"] and not again["changed"] and again["pid"] == first["pid"]  # current: left alone
        assert (status["changed"], status["running"], status["current"]) == (False, True, False)
        assert restart["changed"] and restart["restarted"] and restart["pid"] != first["pid"]  # outdated: restarted
        assert stop["changed"] and stop["pid"] == restart["pid"] and not pid_file.exists()
        for _ in range(50):
            if not any(map(alive, started)):
                break
            time.sleep(0.1)
        assert not any(map(alive, started)), started
        # A pid file that names someone else's process (a reused pid): not ours, not signalled, the file removed.
        pid_file.write_text(f"{stranger.pid}\nv2\n")
        status, stop = run({"state": "status", "version": "v2"}, {"state": "stopped"})
        assert not status["running"] and stop["changed"] and stop["removed_stale_pid_file"]
        assert stranger.poll() is None and not pid_file.exists()
        # A command that ends at once fails the task with the end of its log.
        ends = [sys.executable, "-c", "raise SystemExit('no such export')", "--port", "18999"]
        result = local_playbook(tmp_path / "play.yml", base | {"steps": [{"state": "started", "argv": ends}]})
        assert result.returncode != 0 and "ended at once (exit 1)" in result.stdout, result.stdout[-2000:]
        assert "no such export" in result.stdout
    finally:
        stranger.kill()
        for pid in started:
            if alive(pid):
                os.kill(pid, 9)


READY_PLAY = """
- hosts: localhost
  gather_facts: false
  tasks:
    - xeonsd.cluster.xeonsd_daemon:
        state: started
        argv: "{{ argv }}"
        match: ["--port", "{{ port }}"]
        pid_file: "{{ pid_file }}"
        log: "{{ log }}"
        settle: 0.2
    - xeonsd.cluster.xeonsd_daemon:
        state: ready
        url: "http://127.0.0.1:{{ port }}/v2/health/ready"
        match: ["--port", "{{ port }}"]
        pid_file: "{{ pid_file }}"
        log: "{{ log }}"
        timeout: 120
        interval: 0.2
      register: ready
    - ansible.builtin.copy: {dest: "{{ out }}", content: "{{ ready | to_json }}", mode: "0644"}
"""
# A server that answers 503 until its "pipelines" are compiled (READY_AFTER seconds), then 200; or that exits first.
SERVER = """
import http.server, sys, time
began, ready_after, exit_after = time.monotonic(), float(sys.argv[1]), float(sys.argv[2])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if time.monotonic() - began > ready_after else 503)
        self.end_headers()
    def log_message(self, *a):
        pass
s = http.server.HTTPServer(("127.0.0.1", int(sys.argv[4])), H)
s.timeout = 0.1
while time.monotonic() - began < exit_after:
    s.handle_request()
print("compile failed: no such export", flush=True)
raise SystemExit(1)
"""


def test_the_daemon_module_waits_until_ready_and_names_a_server_that_ended_at_once(tmp_path: Path) -> None:
    """state ready: a server that gets ready after a while is waited for; one that exits while it compiles fails the
    task within seconds (not after the whole timeout) with the end of its log."""
    import socket

    (tmp_path / "play.yml").write_text(READY_PLAY)
    (tmp_path / "server.py").write_text(SERVER)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def wait(ready_after: float, exit_after: float) -> tuple[subprocess.CompletedProcess, float]:
        argv = [sys.executable, str(tmp_path / "server.py"), str(ready_after), str(exit_after), "--port", str(port)]
        values = {"argv": argv, "port": port, "pid_file": str(tmp_path / "s.pid"), "log": str(tmp_path / "s.log")}
        values["ansible_python_interpreter"] = sys.executable
        began = time.monotonic()
        result = local_playbook(tmp_path / "play.yml", values | {"out": str(tmp_path / "out.json")})
        return result, time.monotonic() - began

    ready, _ = wait(ready_after=3, exit_after=60)
    try:
        assert ready.returncode == 0, ready.stdout[-3000:]
        answer = json.loads((tmp_path / "out.json").read_text())
        # (How long it waited depends on this machine's load: the server may be ready before the first look.)
        assert answer["status"] == 200 and answer["waited_s"] >= 0 and not answer["changed"], answer
    finally:
        pid = int((tmp_path / "s.pid").read_text().split()[0]) if (tmp_path / "s.pid").exists() else None
        if pid and alive(pid):
            os.kill(pid, 9)
    ended, seconds = wait(ready_after=60, exit_after=1.5)
    assert ended.returncode != 0, ended.stdout[-3000:]
    assert f"--port {port} is not running (it ended before it was ready" in ended.stdout, ended.stdout[-3000:]
    assert "compile failed: no such export" in ended.stdout
    assert seconds < 60, seconds  # named at once, not after the 120 s timeout


def test_api_keys_become_the_key_file_and_a_bad_list_is_named_without_its_keys() -> None:
    good = [{"name": "alice", "key": "a" * 20}, {"name": "ci", "key": "b" * 24}]
    assert serve.serve_key_file(good) == f"alice:{'a' * 20}\nci:{'b' * 24}\n"
    assert serve.serve_key_file([]) == "" and serve.serve_key_problem([]) == ""
    secret = "s3cr3t-but-short"[:12]
    for bad, said in [
        ("alice:" + "a" * 20, "is a str"),
        ([{"name": "alice"}], "item 1"),
        ([{"name": "a b", "key": "k" * 20}], "'a b' is not a key name"),
        ([{"name": "alice", "key": secret}], "at least 16"),
        ([good[0], {"name": "alice", "key": "c" * 20}], "alice is given twice"),
    ]:
        problem = serve.serve_key_problem(bad)
        assert said in problem and "serve_api_keys" in problem and "Fix:" in problem, problem
        assert secret not in problem and "k" * 20 not in problem and "c" * 20 not in problem
    argv = serve.serve_argv({"export": "/e", "adapters": []}, {"port": 8000, "api-key-file": "/etc/xeonsd/k"})
    assert argv[argv.index("--api-key-file") + 1] == "/etc/xeonsd/k"


TLS_PLAY = """
- hosts: localhost
  gather_facts: false
  tasks:
    - xeonsd.cluster.xeonsd_tls: {dir: "{{ dir }}", names: "{{ names }}"}
      register: made
    - ansible.builtin.copy: {dest: "{{ out }}", content: "{{ made | to_json }}", mode: "0644"}
      check_mode: false
      changed_when: false
"""


def test_the_tls_module_makes_a_ca_and_a_certificate_a_client_trusts_and_keeps_them(tmp_path: Path) -> None:
    """A private CA and a server certificate for the names: nothing written in check mode; made once, then left
    alone (changed=0); a new name issues a new certificate from the same CA; a TLS client that trusts ca.pem (as
    curl --cacert and httpx verify= do) accepts the server by each name and refuses one it does not cover."""
    import socket
    import ssl
    import threading

    (tmp_path / "play.yml").write_text(TLS_PLAY)
    out, d = tmp_path / "out.json", tmp_path / "tls"
    base = {"dir": str(d), "out": str(out), "ansible_python_interpreter": sys.executable}

    def run(names: list[str], *args: str) -> tuple[int, dict]:
        result = local_playbook(tmp_path / "play.yml", base | {"names": names}, *args)
        return changed(result), json.loads(out.read_text())

    assert run(["localhost", "127.0.0.1"], "--check")[0] == 1 and not d.exists()
    first_changed, first = run(["localhost", "127.0.0.1"])
    assert first_changed == 1 and first["issued"] and first["new_ca"]
    assert {p.name: p.stat().st_mode & 0o777 for p in d.iterdir()} == {
        "ca.pem": 0o644,
        "ca.key": 0o600,
        "server.pem": 0o644,
        "server.key": 0o600,
    }
    assert d.stat().st_mode & 0o777 == 0o700
    ca = (d / "ca.pem").read_bytes()
    assert run(["localhost", "127.0.0.1"]) == (0, {**first, "changed": False, "issued": False, "new_ca": False})
    again_changed, again = run(["localhost", "127.0.0.1", "front.example"])
    assert again_changed == 1 and again["issued"] and not again["new_ca"] and (d / "ca.pem").read_bytes() == ca

    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(d / "server.pem", d / "server.key")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def accept(count: int) -> None:
            for _ in range(count):
                conn, _ = listener.accept()
                try:
                    with server.wrap_socket(conn, server_side=True) as tls:
                        tls.sendall(b"ok")
                except (ssl.SSLError, OSError):
                    pass

        thread = threading.Thread(target=accept, args=(4,), daemon=True)
        thread.start()
        client = ssl.create_default_context(cafile=str(d / "ca.pem"))
        for name in ("localhost", "127.0.0.1", "front.example"):
            with socket.create_connection(("127.0.0.1", port)) as raw, client.wrap_socket(raw, server_hostname=name):
                pass
        with socket.create_connection(("127.0.0.1", port)) as raw, pytest.raises(ssl.SSLCertVerificationError):
            client.wrap_socket(raw, server_hostname="other.example")
        thread.join(timeout=10)


def test_the_allow_list_is_addresses_and_every_serve_flag_is_one_xeonsd_serve_takes() -> None:
    import argparse

    from xeonsd.contracts.serve_plan import SERVE_FLAGS
    from xeonsd.serve.command import add_parser

    assert serve.serve_allow_from(["10.0.0.1", "10.0.0.1", "127.0.0.1", "10.1.0.0/16"]) == (
        "10.0.0.1/32,127.0.0.1/32,10.1.0.0/16"
    )
    assert serve.serve_allow_from([]) == ""
    problem = pytest.raises(serve.ServePlanError, serve.serve_allow_from, ["node1"]).value
    assert "'node1' is not an IP address" in str(problem) and "Fix:" in str(problem)
    parser = argparse.ArgumentParser().add_subparsers()
    add_parser(parser)
    known = {o for a in parser.choices["serve"]._actions for o in a.option_strings}
    assert {f"--{flag}" for flag in SERVE_FLAGS} <= known, sorted({f"--{f}" for f in SERVE_FLAGS} - known)
