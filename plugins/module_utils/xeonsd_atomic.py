"""A file written whole or not at all, for the modules: the bytes go to a temporary name in the file's directory
(``mkstemp``: mode 0600 until they are all there), which takes its mode (and owner) and is renamed into place."""

from __future__ import annotations

import os
import tempfile


def write_atomic(path: str, data: bytes, mode: int, owner: tuple[int, int] | None = None) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if owner is not None:
            os.chown(tmp, *owner)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
