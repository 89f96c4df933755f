"""``xeonsd serve``'s process: check everything, listen, compile in the background, serve, stop cleanly.

Order: the options, the export and every adapter are checked (a bad one is a one-line error and exit 2, before
anything is compiled); the engine's pool is chosen (:func:`open_pool`); uvicorn binds the address and logs
``listening on http://HOST:PORT``; the pool compiles (or, torch, loads) its workers (``/v2/health/ready`` answers
503 meanwhile); then one line ``serving on http://HOST:PORT`` goes to stdout.
SIGTERM or SIGINT cancel the requests in flight through the step callback (each is answered 503), uvicorn closes
the connections, the workers' threads end, and the process exits 0. With ``--drain S`` a SIGTERM first drains: the
server reports not ready (a balancer's health check takes it out of rotation) and answers every request for S
seconds, then waits for the requests in flight (at most ``--timeout``), then stops as above; so a rolling restart
behind a balancer loses no request. A second signal stops at once. A compile that fails ends it with exit 1. The
adapters in GenAI's layout and the ``--embeds`` overlay are written to a temporary directory (``TMPDIR``), removed
when the server stops, a refusal or a failed compile included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from xeonsd.serve.options import (
    ServedModel,
    ServeError,
    ServeOptions,
    compiled_copies,
    cpu_count,
    resolve_workers,
)
from xeonsd.serve.pool import WorkerPool
from xeonsd.serve.prepare import prepare

log = logging.getLogger(__name__)
GRACE_S = 10  # seconds uvicorn waits for the connections of cancelled requests to close


def _access_logging() -> None:
    """The access log: bare JSON lines on stderr, not the package's log format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access = logging.getLogger("xeonsd.serve.access")
    access.handlers[:] = [handler]
    access.setLevel(logging.INFO)
    access.propagate = False


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, with the pool's cancellation on SIGTERM/SIGINT and exit 0 after it (uvicorn itself
        re-raises the signal once shut down, which would end the process with -15)."""

        pool: Any = None
        listening: Any = None
        drain_s: float = 0.0
        drain_limit_s: float = 0.0
        _drain_task: Any = None

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGTERM, signal.SIGINT)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            loop = getattr(self, "_loop", None)
            ready = self.pool is not None and self.pool.ready
            # the first SIGTERM of a ready server drains (a draining one is not ready: another signal stops at once)
            if self.drain_s > 0 and sig == signal.SIGTERM and ready and loop is not None and not self.should_exit:
                log.info(
                    "signal %d: draining for %.0f s (not ready, still answering), then stopping", sig, self.drain_s
                )
                loop.call_soon_threadsafe(self._start_drain)
                return
            log.info("signal %d: cancelling the requests in flight and stopping", sig)
            if self.pool is not None and loop is not None:
                loop.call_soon_threadsafe(self.pool.cancel_all, "shutdown")
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

        def _start_drain(self) -> None:
            self._drain_task = asyncio.ensure_future(self._drain())

        async def _drain(self) -> None:
            self.pool.start_draining()
            await asyncio.sleep(self.drain_s)
            deadline = asyncio.get_running_loop().time() + self.drain_limit_s
            while not self.pool.idle and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            log.info("drained; stopping")
            self.should_exit = True

        async def startup(self, sockets: Any = None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)
            if self.started and self.listening is not None:
                self.listening()

    return Server


def bound_address(server: Any, host: str) -> str:
    """``http://HOST:PORT`` of the socket uvicorn bound (``--port 0``: the port the kernel chose)."""
    for srv in server.servers:
        for sock in srv.sockets:
            port = sock.getsockname()[1]
            return f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
    return f"http://{host}:{server.config.port}"


def open_pool(served: ServedModel, opts: ServeOptions, metrics: Any, cores: int) -> WorkerPool:
    """The served model's engine's pool (:mod:`xeonsd.serve.pool`): the torch engine runs one worker on every core;
    GenAI ``--workers`` workers, each on its share."""
    if served.engine == "torch":
        from xeonsd.serve.torch_pool import TorchPool

        if opts.workers not in ("auto", 1):
            raise ServeError(
                f"--workers {opts.workers}: the torch engine runs one request at a time on all {cores} core(s) "
                "(PyTorch's operators use every thread); give --workers 1 or auto"
            )
        return TorchPool(served, workers=1, threads=cores, queue=opts.queue, metrics=metrics, precision=opts.precision)
    from xeonsd.serve.genai_pool import PipelinePool

    workers = resolve_workers(opts.workers, cores, Path(opts.export_dir), compiled_copies(served))
    threads = max(1, cores // workers)
    return PipelinePool(served, workers, threads, opts.queue, metrics, precision=opts.precision)


def serve(opts: ServeOptions, console: TextIO | None = None) -> int:
    import uvicorn

    from xeonsd.serve.app import create_app
    from xeonsd.serve.limits import header_deadline
    from xeonsd.serve.metrics import Metrics

    console = console or sys.stdout
    _access_logging()
    keys = _key_ring(opts)
    cores = cpu_count()
    with tempfile.TemporaryDirectory(prefix="xeonsd-serve-") as workdir:
        served = prepare(opts, Path(workdir))
        metrics = Metrics()
        pool = open_pool(served, opts, metrics, cores)
        workers, threads = pool.workers, pool.threads
        state: dict[str, Any] = {"rc": 0}

        def on_ready() -> None:
            if pool.failure is not None:
                log.error("compiling the pipelines failed: %s", pool.failure)
                print(f"xeonsd serve: error: compiling the pipelines failed: {pool.failure}", file=sys.stderr)
                state["rc"] = 1
                server.should_exit = True
                return
            asyncio.ensure_future(_announce())

        async def _announce() -> None:
            while not server.started and not server.should_exit:  # the compile can finish before the bind
                await asyncio.sleep(0.02)
            if server.started:
                log.info("%d worker(s) x %d thread(s) compiled in %.1f s", workers, threads, pool.compile_s or 0)
                print(f"serving on {bound_address(server, opts.host)}", file=console, flush=True)

        app = create_app(served, opts, pool, metrics, on_ready, keys)
        config = uvicorn.Config(
            app,
            host=opts.host,
            port=opts.port,
            access_log=False,
            log_config=None,
            lifespan="on",
            timeout_graceful_shutdown=GRACE_S,
            http=header_deadline(opts.read_timeout, metrics.refuse),
        )
        server = _server_class()(config)
        server.pool = pool
        server.drain_s, server.drain_limit_s = opts.drain, opts.timeout
        server.listening = lambda: log.info(
            "listening on %s; compiling %d worker(s) of %s (%s), models: %s%s",
            bound_address(server, opts.host),
            workers,
            served.export_dir,
            served.shape.describe(),
            ", ".join(served.model_names),
            f"; concept tokens: {', '.join(served.concept_tokens)}" if served.concept_tokens else "",
        )
        hangup = signal.signal(signal.SIGHUP, lambda *_: keys.reload()) if keys is not None else None
        try:
            server.run()
        finally:
            if keys is not None:
                signal.signal(signal.SIGHUP, hangup)
            pool.cancel_all("shutdown")
            pool.close()
        if state["rc"] == 0 and not server.started:
            raise ServeError(f"cannot listen on {opts.host}:{opts.port} (see the log above)")
        return int(state["rc"])


LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _key_ring(opts: ServeOptions) -> Any:
    """The API keys (:mod:`xeonsd.serve.keys`), or None; without them, one warning when bound beyond loopback."""
    from xeonsd.serve.keys import KeyFileError, KeyRing

    if opts.api_key_file is None:
        if opts.host not in LOOPBACK:
            log.warning(
                "no --api-key-file: anyone who reaches %s:%s can generate images, list the models and read /metrics; "
                "give the server a key file (docs/serving.md)",
                opts.host,
                opts.port,
            )
        return None
    try:
        ring = KeyRing(opts.api_key_file)
    except KeyFileError as e:
        raise ServeError(str(e)) from None
    log.info("%d API key(s) from %s: every route but /v2/health/* needs one", len(ring.keys), opts.api_key_file)
    return ring


def main_args(args: Any, console: TextIO | None = None) -> int:
    """Entry point of ``xeonsd serve`` (parsed by :mod:`xeonsd.cli` from :class:`ServeOptions`' fields)."""
    from xeonsd.flags import from_args

    opts = from_args(ServeOptions, args)
    if opts.write_ovms_config is not None:
        from xeonsd.serve.ovms import write_ovms_config

        out = write_ovms_config(opts)
        print(out, file=console or sys.stdout)
        return 0
    return serve(opts, console)
