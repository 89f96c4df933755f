"""A real ``xeonsd serve`` process for the tests: started on a free port, its output read line by line, its health
polled from the moment it listens until it is ready, stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

LISTENING = re.compile(r"listening on (http://\S+?);")
START_S = 120  # the compile of the tiny export takes seconds; a loaded 2-core machine, more


class ServeProcess:
    def __init__(self, export_dir: Path, *flags: str, env: dict[str, str] | None = None):
        cmd = [sys.executable, "-m", "xeonsd.cli", "serve", str(export_dir), "--port", "0", *flags]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url = ""
        self.ready_statuses: list[int] = []  # /v2/health/ready, polled from listening to ready

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def _wait_line(self, pattern: re.Pattern[str], deadline: float) -> re.Match[str]:
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := pattern.search(line):
                    return m
            if self.proc.poll() is not None:
                raise AssertionError(f"xeonsd serve exited with {self.proc.returncode}:\n" + "\n".join(self.lines))
            time.sleep(0.01)
        raise AssertionError(f"xeonsd serve did not print {pattern.pattern!r}:\n" + "\n".join(self.lines))

    def start(self) -> ServeProcess:
        deadline = time.monotonic() + START_S
        self.url = self._wait_line(LISTENING, deadline)[1]
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while time.monotonic() < deadline:
                try:
                    status = client.get("/v2/health/ready").status_code
                except httpx.TransportError:  # a poll cut off while the loaded machine compiles: poll again
                    time.sleep(0.5)
                    continue
                self.ready_statuses.append(status)
                if status == 200:
                    return self
                time.sleep(0.05)
        raise AssertionError("never ready:\n" + "\n".join(self.lines))

    @classmethod
    @contextlib.contextmanager
    def running(cls, export_dir: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[ServeProcess]:
        """The server started (:meth:`start`) for the block, and stopped (:meth:`stop`) however the block ends: a
        module fixture's ``with ServeProcess.running(export, *flags, env=env) as server: yield server``."""
        proc = cls(export_dir, *flags, env=env)
        try:
            yield proc.start()
        finally:
            proc.stop()

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then the exit status (killed, and an error, if it does not stop in ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            with contextlib.suppress(RuntimeError):
                self._reader.join(5)


PROMPT = "a photo of toy"


def metric(server: ServeProcess, name: str, **labels: str) -> float:
    """The value of one sample of the server's /metrics (0 where it has not been counted yet)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def wait_metric(server: ServeProcess, name: str, value: float, timeout: float = 30, **labels: str) -> None:
    deadline = time.monotonic() + timeout
    while metric(server, name, **labels) != value:
        assert time.monotonic() < deadline, f"{name}{labels} never reached {value}"
        time.sleep(0.02)


def post(server: ServeProcess, steps: int, out: dict, key: str, timeout: float = 60) -> None:
    """One generation request (run in a thread): its response, or the transport error, lands in out[key]."""
    try:
        out[key] = httpx.post(
            f"{server.url}/v3/images/generations",
            json={"prompt": PROMPT, "num_inference_steps": steps},
            timeout=timeout,
        )
    except httpx.HTTPError as exc:
        out[key] = exc
