"""The peak resident memory of this process while a block runs: what ``xeonsd bench generate`` reports per variant,
where every variant loads, runs and closes in the benchmark's own process (ru_maxrss only ever grows, so it cannot
tell one variant from the one before). A thread reads ``VmRSS`` from ``/proc/self/status`` (cheap: no walk of the
mappings) every ``interval_s``; the figure counts what the variant holds on top of the benchmark itself."""

from __future__ import annotations

import threading
from pathlib import Path
from types import TracebackType

STATUS = Path("/proc/self/status")


def resident_bytes() -> int | None:
    """This process's VmRSS now; None where ``/proc/self/status`` has none (not Linux)."""
    try:
        text = STATUS.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


class PeakRss:
    """``with PeakRss() as peak: ...``; then ``peak.bytes``: the largest VmRSS read while the block ran (its start
    and end included), or None where the kernel gives none."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.bytes: int | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="peak-rss", daemon=True)

    def _read(self) -> None:
        now = resident_bytes()
        if now is not None:
            self.bytes = now if self.bytes is None else max(self.bytes, now)

    def _watch(self) -> None:
        while not self._done.wait(self.interval_s):
            self._read()

    def __enter__(self) -> PeakRss:
        self._read()
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._done.set()
        self._thread.join()
        self._read()
