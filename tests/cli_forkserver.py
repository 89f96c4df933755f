"""One warm process per test worker that forks a fresh ``python -m xeonsd.cli`` for each single-process CLI run.

A run of the CLI on the tiny models spends most of its CPU importing torch, diffusers, transformers and peft (about
7 of a 2-step LoRA run's 9.5 s on a 2-core Zen 4); the suite makes a few hundred such runs. The server imports them
once, then forks a child per run: the child is a process of its own (its own pid, globals, signal handlers,
threads started only by it), given the run's arguments, environment, working directory, stdin closed and stdout
and stderr in files, and it ends the way ``python -m xeonsd.cli`` ends (``sys.exit(main())``, the interpreter's
normal shutdown). Nothing of one run stays in the server for the next.

What the fork cannot give is an environment read at import time (huggingface_hub's ``HF_HUB_OFFLINE``, ``HF_HOME``,
the OpenMP runtime's variables ...): the server is started with the first run's environment, and a run whose
environment differs from it (beyond the variables the CLI reads when it runs, RUNTIME_VARIABLES) is run as a plain
subprocess, as is every run when ``XEONSD_TEST_NO_FORKSERVER=1``.

    run(args, env, timeout) -> subprocess.CompletedProcess    # what subprocess.run(capture_output=True) gives
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# What the server imports before it forks: the libraries every CLI run of the tests loads (the OpenVINO side's are
# imported by the runs that use them, after the fork).
WARM = (
    "torch",
    "diffusers",
    "transformers",
    "peft",
    "xeonsd.cli",
    "xeonsd.trainer.loop",
)
# Classes whose first use imports their module (diffusers' lazy modules): touched once in the server.
WARM_ATTRIBUTES = (
    ("diffusers", "UNet2DConditionModel"),
    ("diffusers", "AutoencoderKL"),
    ("diffusers", "StableDiffusionPipeline"),
    ("transformers", "CLIPTextModel"),
    ("transformers", "CLIPTokenizer"),
)
# Variables the CLI reads only while it runs (never a library at import; Intel MPI's are its launcher's): a run may
# differ from the server in them. OMP_NUM_THREADS is the OpenMP runtime's, read when torch loads: the server starts
# without it and a run that has it sets torch's threads to it, as a process started with it begins.
RUNTIME_VARIABLES = ("XEONSD_", "MASTER_PORT", "PYTEST_CURRENT_TEST", "I_MPI_", "OMP_NUM_THREADS")


def _send(sock: socket.socket, obj: object, fds: list[int] = ()) -> None:
    """One message: its length, then its JSON; ``fds`` (a rank's stdout and stderr) travel with it."""
    data = json.dumps(obj).encode()
    frame = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(sock, [frame], fds)
    else:
        sock.sendall(frame)


def _recv(sock: socket.socket, head: bytes = b"") -> object:
    """One message of _send's; ``head``: the part of its length already read (with its descriptors)."""
    head += _recv_exactly(sock, 4 - len(head))
    return json.loads(_recv_exactly(sock, struct.unpack("!I", head)[0]))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the fork server closed the connection")
        buf += chunk
    return buf


# ---- the server (its own process) ----


def _serve(path: str) -> None:
    import importlib

    for name in WARM:
        importlib.import_module(name)
    for module, attr in WARM_ATTRIBUTES:
        getattr(importlib.import_module(module), attr)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    server.settimeout(5)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the monitors are reaped by the kernel
    worker = os.getppid()
    print("ready", flush=True)
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            if os.getppid() != worker:  # the test worker is gone (killed): so is its server
                os._exit(0)
            continue
        conn.settimeout(None)
        sys.stdout.flush(), sys.stderr.flush()
        if os.fork() == 0:  # the monitor: forks the run and reports its pid, then its exit status
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _monitor(conn)
        conn.close()


def _monitor(conn: socket.socket) -> None:
    head, fds, _, _ = socket.recv_fds(conn, 4, 2)  # a rank's shim sends its stdout and stderr with the request
    request = _recv(conn, head)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run(request, fds)  # does not return
    for fd in fds:
        os.close(fd)
    _send(conn, {"pid": pid})
    # Wait for the run; a client that goes away first (a rank's shim killed by mpirun) takes the run with it.
    conn.setblocking(False)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        try:
            if conn.recv(1) == b"":
                _kill_group(pid)
        except BlockingIOError:
            pass
        time.sleep(0.05)
    conn.setblocking(True)
    with contextlib.suppress(OSError):
        _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
    os._exit(0)


def _run(request: dict, fds: list[int]) -> None:
    """The child: becomes ``python -m xeonsd.cli ARGS`` with the request's environment, directory, CPUs and files
    (a rank's: its shim's stdout and stderr)."""
    # A process group of its own (a timeout kills it and whatever it started), in the test worker's session: a
    # session of its own would be a scheduler autogroup of its own, where two runs' OpenMP threads spin against
    # each other (7 s instead of 0.3 s a step on 2 cores).
    os.setpgid(0, 0)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if request.get("affinity"):
        os.sched_setaffinity(0, request["affinity"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    if fds:
        out, err = fds
    else:
        out = os.open(request["stdout"], os.O_WRONLY | os.O_TRUNC)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in (null, out, err):
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if threads := request["env"].get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(threads))
    import xeonsd.cli

    sys.argv = [xeonsd.cli.__file__, *request["args"]]
    # The rest of this process is the CLI's: SystemExit unwinds to the interpreter's normal shutdown, as in
    # `python -m xeonsd.cli` (atexit, flushed files, exit status); an exception prints its traceback, status 1.
    raise SystemExit(xeonsd.cli.main(request["args"]))


# ---- the client (the test worker) ----


class _Server:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = {k: v for k, v in env.items() if k != "OMP_NUM_THREADS"}
        self.dir = Path(tempfile.mkdtemp(prefix="xeonsd-forkserver-"))
        self.path = str(self.dir / "socket")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"import cli_forkserver; cli_forkserver._serve({self.path!r})",
            ],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=open(self.dir / "server.log", "w"),  # noqa: SIM115 - the server's own output, for a failure
            text=True,
        )
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"the CLI fork server did not start: {(self.dir / 'server.log').read_text()[-3000:]}")
        atexit.register(self.stop)

    def differences(self, env: dict[str, str]) -> list[str]:
        """The variables in which ``env`` differs from the server's, but for RUNTIME_VARIABLES."""
        keys = set(env) | set(self.env)
        return sorted(k for k in keys if env.get(k) != self.env.get(k) and not k.startswith(RUNTIME_VARIABLES))

    def run(self, args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(dir=self.dir) as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            out.touch(), err.touch()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(self.path)
            try:
                _send(sock, {"args": args, "env": env, "cwd": os.getcwd(), "stdout": str(out), "stderr": str(err)})
                pid = _recv(sock)["pid"]
                fired = threading.Event()
                timer = threading.Timer(timeout, _kill_group, (pid, fired))
                timer.start()
                try:
                    returncode = _recv(sock)["returncode"]
                finally:
                    timer.cancel()
            finally:
                sock.close()
            argv = [sys.executable, "-m", "xeonsd.cli", *args]
            stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
            if fired.is_set():
                raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr)
            return subprocess.CompletedProcess(argv, returncode, stdout, stderr)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _kill_group(pid: int, fired: threading.Event | None = None) -> None:
    if fired is not None:
        fired.set()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _note(line: str) -> None:
    """XEONSD_TEST_FORKSERVER_LOG=FILE: a line per run, how it was run (to see what falls back, and why)."""
    if log := os.environ.get("XEONSD_TEST_FORKSERVER_LOG"):
        with open(log, "a") as f:
            f.write(line + "\n")


_server: _Server | None = None
_lock = threading.Lock()


def _usable_server(env: dict[str, str], what: str) -> _Server | None:
    """The worker's server (started on first use) where it may run ``env``'s runs, else None (noted)."""
    global _server
    if os.environ.get("XEONSD_TEST_NO_FORKSERVER") == "1":
        return None
    with _lock:
        if _server is None:
            _server = _Server(env)
    differences = _server.differences(env)
    _note(f"{what}: {'fork' if not differences else 'subprocess, the environment differs in ' + ' '.join(differences)}")
    return None if differences else _server


def run(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([python, -m, xeonsd.cli, *args], env=env, capture_output=True, text=True, timeout=...)``,
    forked from the warm server where the environment allows (the module's docstring)."""
    if server := _usable_server(env, "run"):
        return server.run(args, env, timeout)
    return subprocess.run(
        [sys.executable, "-m", "xeonsd.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


# ---- the ranks of a local mpirun ----


def rank_command(env: dict[str, str]) -> list[str]:
    """What ``mpirun -n N`` starts for each rank of ``xeonsd``: a shim that has the worker's server fork the rank
    (with the rank's environment, as mpirun made it, its CPUs and its stdout and stderr, passing signals on and
    exiting as the rank did), or ``python -m xeonsd.cli`` itself where the environment does not allow a fork."""
    if server := _usable_server(env, "ranks"):
        return [sys.executable, __file__, server.path]
    return [sys.executable, "-m", "xeonsd.cli"]


def _shim(path: str, args: list[str]) -> int:
    """One rank: the server forks it; this process stands in for it towards mpirun (signals, exit status)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    request = {"args": args, "env": dict(os.environ), "cwd": os.getcwd(), "affinity": sorted(os.sched_getaffinity(0))}
    _send(sock, request, [1, 2])
    pid = _recv(sock)["pid"]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda signum, _frame: os.kill(pid, signum))
    returncode = _recv(sock)["returncode"]
    if returncode < 0:  # ended by a signal: so does the shim, for mpirun to see
        signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    return returncode


if __name__ == "__main__":
    sys.exit(_shim(sys.argv[1], sys.argv[2:]))
