"""The ASGI app (Starlette): the routes, the OpenAI error bodies, and one JSON access-log line per request.

Routes: ``POST /v3/images/generations`` and ``POST /v1/images/generations`` (one handler: OVMS's and OpenAI's
path), ``POST /v3/images/edits`` and ``/v1/images/edits`` (multipart: :mod:`xeonsd.serve.edits`),
``GET /v1/models`` and ``GET /v3/models`` (the base model, the adapters, then each ``--blend`` as its composite;
each with the ``concept_tokens`` a prompt may name, where the export or ``--embeds`` holds a concept),
``GET /v2/health/live`` (200 while the process serves), ``GET /v2/health/ready`` (200 once every pipeline is
compiled, 503 before), ``GET /metrics`` (Prometheus text format). With ``--api-key-file`` every route but the health checks needs a key
(:mod:`xeonsd.serve.keys`: 401 without one); :func:`guard` puts the access rules and limits before the routes
(:mod:`xeonsd.serve.limits`: 403, 408, 413, 429).

Statuses: 200; 500 a failure inside the pipeline (logged with its traceback; the server goes on); 400 a bad field (``error.param`` names it); 404 an unknown model (the message lists the known
ones); 429 the queue is full (``Retry-After``); 503 not ready yet, or shutting down; 504 past ``--timeout``; 499
(logged and counted only: nobody is left to read it) the client went away and the request was cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from xeonsd.contracts.blend_syntax import composite
from xeonsd.modelfiles.concept_file import prompt_tokens
from xeonsd.serve.edits import parse_form
from xeonsd.serve.keys import KeyRing
from xeonsd.serve.limits import guard
from xeonsd.serve.metrics import Metrics
from xeonsd.serve.options import ServedModel, ServeOptions
from xeonsd.serve.pool import Busy, Cancelled, Job, NotReady, WorkerPool
from xeonsd.serve.requests import Limits, RequestError, parse_body, validate

log = logging.getLogger(__name__)
access_log = logging.getLogger("xeonsd.serve.access")
IMAGE_PATHS = ("/v3/images/generations", "/v1/images/generations")
EDIT_PATHS = ("/v3/images/edits", "/v1/images/edits")  # multipart: xeonsd.serve.edits
KNOWN_PATHS = {*IMAGE_PATHS, *EDIT_PATHS, "/v1/models", "/v3/models", "/v2/health/live", "/v2/health/ready", "/metrics"}
CLIENT_GONE = 499


def _error(status: int, message: str, param: str | None = None, kind: str = "server_error", **headers: str) -> Any:
    from starlette.responses import JSONResponse

    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers or None)


class AccessLog:
    """ASGI middleware: after each HTTP request, one JSON line (method, path, status, seconds, client and what the
    handler put in ``scope["state"]["access"]``) on the ``xeonsd.serve.access`` logger, and the request counter."""

    def __init__(self, app: Any, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        extra: dict[str, Any] = {}
        scope.setdefault("state", {})["access"] = extra
        status = {"code": 500}

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            code = extra.pop("status", status["code"])
            path = scope["path"]
            endpoint = path if path in KNOWN_PATHS else "other"
            seconds = time.perf_counter() - t0
            self.metrics.requests.labels(endpoint, str(code)).inc()
            if path in IMAGE_PATHS or path in EDIT_PATHS:
                self.metrics.latency.labels(path).observe(seconds)
            client = scope.get("client") or ("", 0)
            line = {"time": round(time.time(), 3), "client": f"{client[0]}:{client[1]}", "method": scope["method"]}
            line.update(path=path, status=code, seconds=round(seconds, 4), **extra)
            access_log.info(json.dumps(line, sort_keys=False))


async def _watch_disconnect(receive: Callable, job: Job) -> None:
    """Cancel ``job`` when the client closes the connection (the body is read: the next message is the end)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            job.cancel("disconnect")
            return


def _images_handler(limits: Limits, timeout: float, pool: WorkerPool, metrics: Metrics, edit: bool = False) -> Callable:
    """The handler of both image paths (``edit``: of both edit paths): validate, queue, generate, answer (or
    cancel)."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response

    async def images(request: Request) -> Response:
        arrived = time.monotonic()
        access = request.scope["state"]["access"]
        try:
            body = await parse_form(request, limits) if edit else parse_body(await request.body())
            req = validate(body, limits, edit)
        except RequestError as exc:
            metrics.rejected.labels(exc.param or "body").inc()
            access["error"] = str(exc)
            return JSONResponse(exc.body(), status_code=exc.status)
        access.update(model=req.model, n=req.n, steps=req.steps, seed=req.seed, kind=req.kind)
        job = Job(request=req, deadline=arrived + timeout, timeout=timeout)
        watcher = asyncio.ensure_future(_watch_disconnect(request.receive, job))
        try:
            data = await pool.run(job)
        except NotReady as exc:
            return _error(503, str(exc), kind="service_unavailable")
        except Busy as exc:
            metrics.refuse("queue_full")
            return _error(429, str(exc), kind="rate_limit_exceeded", **{"Retry-After": str(exc.retry_after)})
        except Cancelled as exc:
            access.update(cancelled=exc.reason, steps_done=job.steps_done)  # the steps it ran before it stopped
            if exc.reason == "disconnect":
                access["status"] = CLIENT_GONE
                return Response(status_code=CLIENT_GONE)
            return _error(504 if exc.reason == "timeout" else 503, str(exc), kind=exc.reason)
        except Exception as exc:  # a failure inside the pipeline: this request fails, the server goes on
            log.exception("request failed: %s", exc)
            access["error"] = f"{type(exc).__name__}: {exc}"
            return _error(500, f"generation failed: {type(exc).__name__}: {exc}")
        finally:
            watcher.cancel()
        metrics.images.labels(req.label).inc(len(data))
        return JSONResponse({"created": int(time.time()), "data": [{"b64_json": b} for b in data]})

    return images


def create_app(
    served: ServedModel,
    opts: ServeOptions,
    pool: WorkerPool,
    metrics: Metrics,
    on_ready: Callable[[], None],
    keys: KeyRing | None = None,
) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    limits = Limits(
        shape=served.shape,
        models=tuple(served.model_names),
        max_images=opts.max_images,
        max_steps=opts.max_steps,
        guidance_scale=served.guidance_scale,
        alphas=tuple((name, alpha) for name, (_, alpha) in served.adapters.items()),
        family=served.family.label,
        edits=served.edits,
        fused_only=served.engine == "genai" and not served.family.genai_adapters,
        blends=served.blends,
        references=served.references,
        reference_required=served.references > 0 and served.family.reference_required,
        engine="the PyTorch engine" if served.engine == "torch" else Limits.engine,
        default_steps=served.default_steps,
    )
    created = int(time.time())
    images = _images_handler(limits, opts.timeout, pool, metrics)
    edits = _images_handler(limits, opts.timeout, pool, metrics, edit=True)

    ids = [*limits.models, *(composite(key) for key in limits.blends)]
    # every model answers to the export's concept(s) and --embeds': its text encoders are the pipelines' own
    concepts = {"concept_tokens": prompt_tokens(served.concept_tokens)} if served.concept_tokens else {}

    async def models(request: Request) -> Response:
        rows = [{"id": name, "object": "model", "created": created, "owned_by": "xeonsd", **concepts} for name in ids]
        return JSONResponse({"object": "list", "data": rows})

    async def live(request: Request) -> Response:
        return JSONResponse({"status": "live"})

    async def ready(request: Request) -> Response:
        if pool.ready:
            return JSONResponse({"status": "ready", "workers": pool.workers})
        status = "draining" if pool.draining else "loading"
        return JSONResponse({"status": status, "workers": pool.workers}, status_code=503)

    async def prometheus(request: Request) -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        loader = threading.Thread(target=pool.load, args=(loop, on_ready), name="xeonsd-compile", daemon=True)
        loader.start()
        try:
            yield
        finally:
            pool.cancel_all("shutdown")

    routes = [Route(p, images, methods=["POST"]) for p in IMAGE_PATHS]
    routes += [Route(p, edits, methods=["POST"]) for p in EDIT_PATHS]
    routes += [Route(p, models, methods=["GET"]) for p in ("/v1/models", "/v3/models")]
    routes += [
        Route("/v2/health/live", live, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    return AccessLog(guard(app, opts, metrics, keys), metrics)
