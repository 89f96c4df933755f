"""What a public ``xeonsd serve`` refuses, before a request reaches a route: who may connect, how large and how slow
a request may be, and how often one key may call.

* ``--allow-from CIDR[,CIDR...]`` (:class:`AllowFrom`): a connection from an address outside the networks is
  answered 403 (``code: address_not_allowed``) before any other work; loopback is always allowed, so the node's own
  checks work. The address is the one uvicorn gives (the TCP peer: the front, for requests that came through it).
* ``--max-body-bytes N`` (:class:`ReadBody`): a ``Content-Length`` above N is answered 413 (``body_too_large``)
  without reading the body; a body without one (chunked) is read up to N bytes and answered 413 as soon as it
  passes them. The body is read here, whole, and handed to the route from memory.
* ``--read-timeout S``: the body must arrive within S seconds of the headers, or the request is answered 408
  (``read_timeout``); the headers must arrive within S seconds of the connection (or of the data that starts the
  next request on a kept-alive one), or the connection is answered 408 and closed (:func:`header_deadline`, a
  deadline uvicorn's h11 protocol lacks: it has only ``timeout_keep_alive``, between requests). Neither holds a
  pipeline worker meanwhile: a worker is taken only once the whole body is read and valid.
* ``--rate-limit N`` (:class:`RateLimit`, :class:`TokenBuckets`): N requests per minute per API key name (per client
  address without ``--api-key-file``), a burst of N then one every 60/N s; past it 429 with ``Retry-After``
  (``rate_limit_exceeded``). The health checks and ``/metrics`` are not counted.

Every refusal is an OpenAI error object, counted in ``xeonsd_serve_refused_total{reason}`` (the ``code``); 403, 408
and 413 close the connection.
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from xeonsd.serve.keys import KeyRing, RequireKey
from xeonsd.serve.metrics import Metrics
from xeonsd.serve.options import Network, ServeOptions
from xeonsd.serve.requests import refuse

UNCOUNTED = ("/v2/health/", "/metrics")  # paths the rate limit does not count
MAX_KEYS = 65536  # rate-limit buckets kept at most (each ~200 bytes); past it the least recently used is forgotten
REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def _access(scope: dict) -> dict[str, Any]:
    return scope.setdefault("state", {}).setdefault("access", {})


def client_allowed(host: str | None, networks: tuple[Network, ...]) -> bool:
    """Whether a client at ``host`` may call: loopback always, else an address in one of ``networks``."""
    try:
        address = ipaddress.ip_address((host or "").split("%")[0])
    except ValueError:
        return False  # no IP address (a Unix socket): not one the allow-list names
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # a dual-stack socket's view of an IPv4 client
    return address.is_loopback or any(address in net for net in networks)


class AllowFrom:
    """ASGI middleware: 403 to a client outside ``networks`` (loopback always passes)."""

    def __init__(self, app: Any, networks: tuple[Network, ...], refused: Callable[[str], None]) -> None:
        self.app = app
        self.networks = networks
        self.refused = refused

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        client = scope.get("client") or (None, 0)
        if scope["type"] != "http" or client_allowed(client[0], self.networks):
            await self.app(scope, receive, send)
            return
        nets = ", ".join(str(n) for n in self.networks)
        message = f"requests from {client[0]} are not allowed here (--allow-from {nets}); call through the front"
        await refuse(send, self.refused, message, 403, "address_not_allowed", kind="permission_denied")


class ReadBody:
    """ASGI middleware: read the whole body within ``timeout`` seconds and ``limit`` bytes (else 408 or 413), then
    call the app with a ``receive`` that gives it that body (and afterwards what the client's ``receive`` gives)."""

    def __init__(self, app: Any, limit: int, timeout: float, refused: Callable[[str], None]) -> None:
        self.app = app
        self.limit = limit
        self.timeout = timeout
        self.refused = refused

    async def _too_large(self, send: Callable, size: str) -> None:
        message = f"the request body is {size}; this server takes at most {self.limit} bytes (--max-body-bytes)"
        await refuse(send, self.refused, message, 413, "body_too_large")

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope.get("headers", []) if k == b"content-length"), None)
        if length is not None and int(length) > self.limit:  # h11 has checked that it is a number
            await self._too_large(send, f"{int(length)} bytes (Content-Length)")
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                message = (
                    f"the request body did not arrive within {self.timeout:g} s (--read-timeout); {size} bytes came"
                )
                await refuse(send, self.refused, message, 408, "read_timeout")
                return
            if message["type"] == "http.disconnect":
                _access(scope)["status"] = 499  # the client left before its body was read: no one to answer
                return
            size += len(message.get("body", b""))
            if size > self.limit:
                await self._too_large(send, f"more than {self.limit} bytes (chunked, cut off)")
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        given = False

        async def replay() -> dict:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class TokenBuckets:
    """``per_minute`` requests per key: a bucket of that many tokens, refilled at ``per_minute``/60 a second.
    Thread-safe. A bucket idle for a minute is full again, the same as a new one, so it is forgotten; past
    ``max_keys`` buckets the least recently used goes too (that key then starts full)."""

    def __init__(self, per_minute: int, max_keys: int = MAX_KEYS, clock: Callable[[], float] = time.monotonic):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.max_keys = max_keys
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, when), oldest first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: str) -> float:
        """Take a token for ``key``: 0.0 if it had one, else the seconds until it has one (nothing taken)."""
        with self._lock:
            now = self.clock()
            tokens, when = self._buckets.pop(key, (self.capacity, now))
            tokens = min(self.capacity, tokens + (now - when) * self.rate)
            wait = 0.0 if tokens >= 1 else (1 - tokens) / self.rate
            self._buckets[key] = (tokens - 1 if wait == 0 else tokens, now)
            self._forget(now)
            return wait

    def _forget(self, now: float) -> None:
        full_after = self.capacity / self.rate  # seconds an empty bucket takes to fill: 60
        while self._buckets:
            key, (_, when) = next(iter(self._buckets.items()))
            if len(self._buckets) <= self.max_keys and now - when < full_after:
                return
            del self._buckets[key]


class RateLimit:
    """ASGI middleware: 429 with ``Retry-After`` past ``buckets``' rate, keyed by the API key's name that
    :class:`~xeonsd.serve.keys.RequireKey` put in the access line (``by_key``), else by the client's address."""

    def __init__(self, app: Any, buckets: TokenBuckets, by_key: bool, refused: Callable[[str], None]) -> None:
        self.app = app
        self.buckets = buckets
        self.by_key = by_key
        self.refused = refused

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"].startswith(UNCOUNTED):
            await self.app(scope, receive, send)
            return
        who = f"key {_access(scope).get('key')}" if self.by_key else f"address {(scope.get('client') or ('?',))[0]}"
        wait = self.buckets.take(who)
        if wait == 0:
            await self.app(scope, receive, send)
            return
        retry = max(1, math.ceil(wait))
        per = int(self.buckets.capacity)
        message = f"rate limit of {per} requests a minute reached for {who} (--rate-limit); retry after {retry} s"
        code = "rate_limit_exceeded"
        await refuse(send, self.refused, message, 429, code, kind=code, close=False, **{"Retry-After": str(retry)})


def guard(app: Any, opts: ServeOptions, metrics: Metrics, keys: KeyRing | None) -> Any:
    """The checks before a route, outermost first: the address (403), the key (401), the rate (429), the body's
    size and time (413, 408); each refuses without doing the work of the next."""
    app = ReadBody(app, opts.max_body_bytes, opts.read_timeout, metrics.refuse)
    if opts.rate_limit:
        app = RateLimit(app, TokenBuckets(opts.rate_limit), keys is not None, metrics.refuse)
    if keys is not None:
        app = RequireKey(app, keys, lambda name: metrics.key_requests.labels(name).inc(), metrics.refuse)
    if opts.allow_from:
        app = AllowFrom(app, opts.allow_from, metrics.refuse)
    return app


def header_deadline(timeout: float, refused: Callable[[str], None]) -> type:
    """uvicorn's h11 protocol with a deadline on the headers: a connection whose request line and headers have not
    all come ``timeout`` seconds after it opened, or after the first bytes of its next request, is answered 408 and
    closed (closed without an answer if it sent nothing: a pre-connect)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _waiting_on: Any = None  # the request cycle in place when the deadline was set
        _bytes = 0

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._timer is None and self._between_requests():
                self._arm()
            self._bytes += len(data)
            super().data_received(data)

        def on_response_complete(self) -> None:
            self._disarm()  # the next request's first bytes set the deadline again
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._waiting_on, self._bytes = self.cycle, 0
            self._timer = self.loop.call_later(timeout, self._expired)

        def _expired(self) -> None:
            self._timer = None
            if self.cycle is not self._waiting_on or not self._between_requests() or self.transport.is_closing():
                return  # the headers came: the body's deadline is ReadBody's
            if self._bytes:
                refused("header_timeout")
                self.transport.write(REQUEST_TIMEOUT)
            self.transport.close()

    return HeaderDeadline
