"""The peak resident memory of this process while a block runs: what ``xeonsd bench generate`` reports per variant,
where every variant loads, runs and closes in the benchmark's own process (ru_maxrss only ever grows, so it cannot
tell one variant from the one before). A thread reads ``VmRSS`` (:func:`xeonsd.cluster.memory.resident_bytes`) every
``interval_s``; the figure is the whole process's: the benchmark's own memory plus what the variant holds."""

from __future__ import annotations

import threading
from types import TracebackType

from xeonsd.cluster.memory import resident_bytes


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
