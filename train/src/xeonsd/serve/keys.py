"""``xeonsd serve --api-key-file FILE``: who may call the server (OVMS's ``--api_key_file``, sent the same way).

The file holds one key per line, ``KEY`` or ``NAME:KEY``; blank lines and ``#`` comments are ignored, and an
unnamed key is called ``key1``, ``key2``, … in the order of the unnamed ones. With a key file every route but
``/v2/health/*`` (what a balancer's health check asks) needs ``Authorization: Bearer KEY``, what the ``openai``
client sends for ``api_key=``; a request without it, or with a key the file does not hold, is answered 401 with an
OpenAI error object (``code: invalid_api_key``). The key a request gives is compared with every key in constant
time (:func:`hmac.compare_digest`, no early exit) and never logged: the access log and ``/metrics``
(``xeonsd_serve_key_requests_total{key}``) carry its name. SIGHUP reloads the file between requests; a file that
no longer parses keeps the keys in force and logs why.
"""

from __future__ import annotations

import hmac
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xeonsd.serve.requests import refuse

log = logging.getLogger(__name__)
MIN_KEY = 16  # characters: a key a person would type by hand is too easy to guess
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
KEY = re.compile(r"^[!-~]+$")  # printable ASCII without spaces: what fits a header
OPEN_PATHS = "/v2/health/"


class KeyFileError(ValueError):
    """The key file cannot be used; the message names the file, the line and the fix."""


def parse_keys(text: str, where: str) -> dict[str, bytes]:
    """``{name: key}`` of a key file's ``text`` (``where``: its path, for the messages)."""
    keys: dict[str, bytes] = {}
    unnamed = 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, key = line.partition(":")
        if not sep:
            unnamed += 1
            name, key = f"key{unnamed}", line
        if not NAME.match(name):
            raise KeyFileError(f"{where} line {number}: {name!r} is not a key name (letters, digits, '.', '_', '-')")
        if not KEY.match(key) or len(key) < MIN_KEY:
            raise KeyFileError(
                f"{where} line {number} ({name}): a key is at least {MIN_KEY} printable characters without spaces; "
                "make one with: python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        if name in keys:
            raise KeyFileError(f"{where} line {number}: the name {name} is given twice; give each key its own")
        if key.encode() in keys.values():
            raise KeyFileError(f"{where} line {number} ({name}): the same key is given twice")
        keys[name] = key.encode()
    if not keys:
        raise KeyFileError(f"{where} holds no key: one per line, KEY or NAME:KEY")
    return keys


def read_keys(path: Path) -> dict[str, bytes]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise KeyFileError(f"--api-key-file {path} cannot be read: {e.strerror or e}") from None
    return parse_keys(text, str(path))


class KeyRing:
    """The keys in force: read at start-up, reloaded by :meth:`reload` (SIGHUP)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.keys = read_keys(self.path)

    def reload(self) -> bool:
        """Read the file again; on an error keep the keys in force and log why. True when reloaded."""
        try:
            keys = read_keys(self.path)
        except KeyFileError as e:
            log.error("SIGHUP: the API keys are unchanged (%d in force): %s", len(self.keys), e)
            return False
        self.keys = keys  # one assignment: a request sees the old set or the new one
        log.info("SIGHUP: %d API key(s) loaded from %s", len(keys), self.path)
        return True

    def name_of(self, authorization: str | None) -> str | None:
        """The name of the key an ``Authorization: Bearer KEY`` header gives, None if it gives none we hold."""
        scheme, _, token = (authorization or "").partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        found = None
        for name, key in self.keys.items():  # every key, equal time whichever matches
            if hmac.compare_digest(given, key):
                found = name
        return found


class RequireKey:
    """ASGI middleware: a request outside ``/v2/health/*`` needs a key the ring holds (else 401); the key's name
    goes into the access line (``scope["state"]["access"]["key"]``) and the per-key request counter."""

    def __init__(
        self, app: Any, ring: KeyRing, count: Callable[[str], None], refused: Callable[[str], None] | None = None
    ) -> None:
        self.app = app
        self.ring = ring
        self.count = count
        self.refused = refused or (lambda reason: None)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"].startswith(OPEN_PATHS):
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
        name = self.ring.name_of(header.decode("latin-1"))
        access = scope.setdefault("state", {}).setdefault("access", {})
        access["key"] = name
        self.count(name or "(none)")
        if name is None:
            message = (
                "Incorrect API key provided: send Authorization: Bearer KEY with a key of this server's --api-key-file"
                if header
                else "No API key provided: send Authorization: Bearer KEY (the openai client's api_key=)"
            )
            await refuse(
                send, self.refused, message, 401, "invalid_api_key", close=False, **{"WWW-Authenticate": "Bearer"}
            )
            return
        await self.app(scope, receive, send)
