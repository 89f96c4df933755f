"""The server's Prometheus metrics (``GET /metrics``), in a registry of their own (no process-global state).

* ``xeonsd_serve_requests_total{endpoint, status}``: every answered request, by HTTP status (499: the client went
  away first, as nginx counts it);
* ``xeonsd_serve_request_seconds{endpoint}``: latency histogram of the image requests, arrival to answer;
* ``xeonsd_serve_queue_depth``: requests waiting for a free worker now; ``xeonsd_serve_busy_workers``: working now;
* ``xeonsd_serve_images_total{model}``: images returned;
* ``xeonsd_serve_step_seconds``: seconds per denoising step (a call's time over its steps, VAE and text encoder
  included: what a step costs a client);
* ``xeonsd_serve_cancelled_total{reason}``: requests cancelled (timeout, disconnect, shutdown), waiting in the
  queue or generating (then stopped through GenAI's step callback);
* ``xeonsd_serve_rejected_total{param}``: requests refused as invalid, by the field named in the error;
* ``xeonsd_serve_ready``: 1 once every pipeline is compiled;
* ``xeonsd_serve_key_requests_total{key}``: with ``--api-key-file``, requests by the name of the key they gave
  (``(none)``: no key the server holds; answered 401);
* ``xeonsd_serve_refused_total{reason}``: requests refused before a route took them, by the error's code
  (:mod:`xeonsd.serve.limits`: ``address_not_allowed``, ``invalid_api_key``, ``body_too_large``, ``read_timeout``,
  ``header_timeout``, ``rate_limit_exceeded``) and by the route's queue (``queue_full``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
STEP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8)


@dataclass
class Metrics:
    registry: Any = field(default=None)

    def __post_init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "xeonsd_serve_requests", "Answered requests by endpoint and HTTP status", ["endpoint", "status"], registry=r
        )
        self.latency = Histogram(
            "xeonsd_serve_request_seconds",
            "Image request latency, arrival to answer",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("xeonsd_serve_queue_depth", "Requests waiting for a free worker", registry=r)
        self.busy = Gauge("xeonsd_serve_busy_workers", "Workers generating now", registry=r)
        self.images = Counter("xeonsd_serve_images", "Images returned", ["model"], registry=r)
        self.step_seconds = Histogram(
            "xeonsd_serve_step_seconds", "Seconds per denoising step", buckets=STEP_BUCKETS, registry=r
        )
        self.cancelled = Counter(
            "xeonsd_serve_cancelled", "Requests cancelled, waiting or generating", ["reason"], registry=r
        )
        self.rejected = Counter("xeonsd_serve_rejected", "Invalid requests by the field refused", ["param"], registry=r)
        self.ready = Gauge("xeonsd_serve_ready", "1 once every pipeline is compiled", registry=r)
        self.key_requests = Counter(
            "xeonsd_serve_key_requests", "Requests by the name of the API key they gave", ["key"], registry=r
        )

        self.refused = Counter(
            "xeonsd_serve_refused", "Requests refused by access rule or limit, by reason", ["reason"], registry=r
        )

    def refuse(self, reason: str) -> None:
        self.refused.labels(reason).inc()

    def exposition(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
