"""Where a command's model comes from, checked before anything loads it: a local directory or a Hub id.

A mistyped id, or a Hub id on a node that cannot reach the Hub, used to end in a traceback after the download
client's five retries. Every command that takes a model (``train``, ``export``, ``doctor``, ``bench``) asks
:func:`check_model_source` first and ends with one line instead: the id, where it was looked for, what to do.

* An existing directory must hold ``model_index.json`` (a diffusers pipeline).
* A path that does not exist and is not a Hub id (``owner/name``) fails at once.
* A Hub id goes on as before when the Hub's host name resolves (one DNS lookup, no retries: real clusters
  download). Offline (``HF_HUB_OFFLINE=1``) it goes on only when the Hub cache holds it at that revision; where
  the host does not resolve it fails at once, and says so when the cache holds it (``HF_HUB_OFFLINE=1`` then loads
  it from there without the network).
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

# A DNS lookup that takes longer than this counts as "does not resolve" (a node whose resolver is unreachable).
DNS_TIMEOUT_S = 5.0

FIX_LOCAL = "give the path of a local diffusers pipeline directory"
FIX_STAGE = "stage the model on every node with the base_model role (provision.yml)"
FIX_OFFLINE = "on nodes without network set HF_HUB_OFFLINE=1"


class ModelSourceError(ValueError):
    """The model cannot come from where it was asked for; the message is one line that says what to do."""


@dataclass(frozen=True)
class ModelSource:
    """Where the model will be loaded from: ``kind`` is "local" (a directory), "hub-cache" (offline, the Hub
    cache holds it) or "hub" (the Hub's host resolves: downloaded, or taken from the cache)."""

    kind: str
    detail: str

    def __str__(self) -> str:
        return self.detail


def looks_like_hub_id(model: str) -> bool:
    """``owner/name`` with the Hub's characters; paths (``./x``, ``/x``, ``~/x``, ``a/b/c``) are not Hub ids."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        return False
    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def host_resolves(host: str, timeout_s: float = DNS_TIMEOUT_S) -> bool:
    """One ``getaddrinfo`` of ``host``, given up after ``timeout_s`` (the lookup itself cannot be interrupted, so it
    runs in a daemon thread that is left to finish on its own)."""
    answer: list[bool] = []

    def lookup() -> None:
        try:
            socket.getaddrinfo(host, 443, type=socket.SOCK_STREAM)
            answer.append(True)
        except (OSError, UnicodeError):
            answer.append(False)

    probe = threading.Thread(target=lookup, name="xeonsd-hub-dns", daemon=True)
    probe.start()
    probe.join(timeout_s)
    return bool(answer and answer[0])


def _in_hub_cache(model: str, revision: str | None, cache_dir: str | Path | None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(model, "model_index.json", cache_dir=cache_dir, revision=revision), str)


def _not_found(flag: str, model: str, hub: str, fixes: list[str]) -> ModelSourceError:
    return ModelSourceError(
        f"{flag} {model}: cannot be loaded: looked for as a local directory (not found) and on the Hub ({hub}). "
        f"Fix: {'; '.join(fixes)}"
    )


def check_model_source(
    model: str,
    *,
    revision: str | None = None,
    flag: str = "--pretrained_model_name_or_path",
    hub: bool = True,
    offline: bool | None = None,
    endpoint: str | None = None,
    cache_dir: str | Path | None = None,
    dns_timeout_s: float = DNS_TIMEOUT_S,
) -> ModelSource:
    """Check that ``model`` can be loaded from where it names; return where that is.

    ``hub=False``: the command reads the directory itself, so only a local directory will do. ``offline``,
    ``endpoint`` and ``cache_dir`` default to huggingface_hub's (``HF_HUB_OFFLINE``, ``HF_ENDPOINT``,
    ``HF_HUB_CACHE``), which the loading libraries use too. Raises :class:`ModelSourceError`.
    """
    from huggingface_hub import constants

    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "model_index.json").is_file():
            raise ModelSourceError(
                f"{flag} {model}: the local directory {path} is not a diffusers pipeline (no model_index.json). "
                f"Fix: {FIX_LOCAL} (the directory that holds model_index.json); {FIX_STAGE}"
            )
        return ModelSource("local", f"local directory {path}")
    if path.exists():
        raise ModelSourceError(
            f"{flag} {model}: {path} is a file, not a diffusers pipeline directory. Fix: {FIX_LOCAL}"
        )
    if not hub:
        raise ModelSourceError(
            f"{flag} {model}: cannot be loaded: looked for as a local directory (not found); this command reads a "
            f"local directory only and does not download from the Hub. Fix: {FIX_LOCAL}; {FIX_STAGE}"
        )
    fixes = [FIX_LOCAL, FIX_STAGE, FIX_OFFLINE]
    if not looks_like_hub_id(model):
        raise _not_found(flag, model, "not looked for: a Hub id reads 'owner/name'", fixes)
    offline = constants.HF_HUB_OFFLINE if offline is None else offline
    cached = _in_hub_cache(model, revision, cache_dir)
    at = "" if revision is None else f" at revision {revision}"
    if offline:
        if cached:
            return ModelSource("hub-cache", f"Hub id {model}{at}, in the Hub cache (offline)")
        cache = cache_dir or constants.HF_HUB_CACHE
        fixes[2] = "or download it into the Hub cache where there is network (HF_HUB_OFFLINE=1 then reads it there)"
        raise _not_found(flag, model, f"offline: HF_HUB_OFFLINE=1, and the Hub cache {cache} has no copy{at}", fixes)
    host = urlparse(endpoint or constants.ENDPOINT).hostname or str(endpoint or constants.ENDPOINT)
    if not host_resolves(host, dns_timeout_s):
        why = f"host {host} does not resolve"
        if cached:
            why += "; the Hub cache has a copy, which HF_HUB_OFFLINE=1 loads without the network"
        raise _not_found(flag, model, why, fixes)
    return ModelSource("hub", f"Hub id {model}{at}: {host} resolves (downloaded, or taken from the Hub cache)")


def model_fingerprint(src: str, revision: str | None = None, subfolder: str | None = None) -> str:
    """A short digest that tells base models apart, so that a checkpoint or adapter trained on another base is
    refused. For a local pipeline: its configs, and the size plus first and last MiB of each weight file (cheap
    on multi-GB files, and two differently trained models differ there); for a Hub id: the id and revision.
    With ``subfolder``, only that component (e.g. ``vae``)."""
    root = Path(src).expanduser()
    h = hashlib.sha256()
    if not (root / "model_index.json").is_file():
        h.update(json.dumps([src, revision, subfolder]).encode())
        return h.hexdigest()[:16]
    chunk = 1 << 20
    top = root / subfolder if subfolder else root
    for path in sorted(p for p in top.rglob("*") if p.is_file() and not p.name.startswith(".")):
        rel = path.relative_to(root).as_posix()
        if path.suffix in (".json", ".txt"):
            h.update(f"{rel}\0".encode() + path.read_bytes())
        elif path.suffix in (".safetensors", ".bin", ".ckpt", ".pt"):
            size = path.stat().st_size
            with open(path, "rb") as fh:
                head = fh.read(chunk)
                fh.seek(max(0, size - chunk))
                tail = fh.read(chunk)
            h.update(f"{rel}\0{size}\0".encode() + head + tail)
    return h.hexdigest()[:16]
