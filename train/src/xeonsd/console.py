"""A command's console: its own lines and the libraries' real errors; their chatter goes to a log file.

The libraries a command loads talk a lot: deprecation notices, the safety-checker notice, progress bars, lines
printed by C++ (OpenVINO) or with ``print``. :func:`quiet_console` points the process's stdout and stderr (the file
descriptors, so C++ output is caught too) at a log file for the length of the command. On the console stay the
records of the ``xeonsd`` loggers, every record of level ERROR or above from any logger, the command's own output
(written to the stream the context yields) and, when the command fails, the last lines of the log. With
``verbose`` everything goes to the console as well as to the log.

Standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

OUR_LOGGER = "xeonsd"
TAIL_LINES = 15


class _OursOrErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        ours = record.name == OUR_LOGGER or record.name.startswith(OUR_LOGGER + ".")
        return (ours and record.levelno >= logging.INFO) or record.levelno >= logging.ERROR


def log_path_beside(out: str | os.PathLike) -> Path:
    """The log file of a command that writes ``out``: ``<out>.log`` beside it."""
    out = Path(out)
    return out.parent / f"{out.name}.log"


def _flush_c_stdio() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)


def _tee(read_fd: int, log_fd: int, console_fd: int) -> None:
    while chunk := os.read(read_fd, 65536):
        os.write(log_fd, chunk)
        with contextlib.suppress(OSError):
            os.write(console_fd, chunk)


def _tail(path: Path, n: int) -> list[str]:
    with contextlib.suppress(OSError):
        lines = path.read_text(errors="replace").replace("\r", "\n").splitlines()
        return [line for line in lines if line.strip()][-n:]
    return []


def _put_log_in_place(tmp_log: Path, log_path: Path, refused: bool, show_tail: bool, console: TextIO) -> None:
    if refused:  # the command refused its input: nothing ran, an earlier run's log stays as it was
        tmp_log.unlink(missing_ok=True)
        return
    kept = log_path.parent.is_dir()  # a command that never made its output directory leaves no log behind
    lines = _tail(tmp_log, TAIL_LINES) if show_tail else []
    if kept:
        os.chmod(tmp_log, 0o644)
        os.replace(tmp_log, log_path)
    else:
        tmp_log.unlink(missing_ok=True)
    if lines:
        where = f"is in {log_path}" if kept else "was"
        print(f"the libraries' output {where}; its last lines:", file=console)
        for line in lines:
            print(f"  {line}", file=console)


def _existing_dir(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (the log's temporary file goes there until the command has
    made its output directory)."""
    while not path.is_dir() and path != path.parent:
        path = path.parent
    return path


@contextlib.contextmanager
def quiet_console(
    log_path: Path, verbose: bool = False, expected: tuple[type[BaseException], ...] = (), both: bool = False
) -> Iterator:
    """Send stdout and stderr to ``log_path`` (and, ``verbose``, to the console too) while the block runs; yields
    the console's stdout for the command's own output (``both``: its stdout and stderr). The log's directory may
    not exist yet (a trainer makes its output directory): the log is placed there if it exists at the end. The log is written under a temporary name and renamed into
    place when the block ends. An exception out of the block shows the log's last lines, unless it is one of
    ``expected`` (the command's own errors, which say what is wrong: then no log is left, and an earlier one stays). Where the log cannot be
    opened (the command's output directory is not writable: the command reports that itself) nothing is
    captured."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        log_path = Path(log_path)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{log_path.name}.tmp-", dir=_existing_dir(log_path.parent))
        os.close(fd)
        tmp_log = Path(tmp_name)
        log_fd = os.open(tmp_log, os.O_WRONLY | os.O_TRUNC)
    except OSError:
        yield (sys.stdout, sys.stderr) if both else sys.stdout
        return
    saved_out, saved_err = os.dup(1), os.dup(2)
    console_out = os.fdopen(os.dup(saved_out), "w", buffering=1)
    console_err = os.fdopen(os.dup(saved_err), "w", buffering=1)
    root = logging.getLogger()
    console_handler = None
    tee = None
    if verbose:  # a pipe, and a thread that copies it to the log and the console
        read_fd, write_fd = os.pipe()
        tee = threading.Thread(target=_tee, args=(read_fd, log_fd, saved_err), daemon=True)
        tee.start()
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
    else:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        console_handler = logging.StreamHandler(console_err)
        console_handler.addFilter(_OursOrErrors())
        plain = [h for h in root.handlers if isinstance(h, logging.StreamHandler)]
        if plain and plain[0].formatter is not None:
            console_handler.setFormatter(plain[0].formatter)
        root.addHandler(console_handler)
    # Python-level writers go to the new descriptors too, even where sys.stdout was swapped for another object.
    saved_streams = sys.stdout, sys.stderr
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (flushed in the finally below)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    failed = refused = False
    try:
        yield (console_out, console_err) if both else console_out
    except BaseException as exc:
        refused = isinstance(exc, expected)
        failed = not refused
        raise
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = saved_streams
        _flush_c_stdio()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)
        if tee is not None:
            tee.join(timeout=5)  # every writer of the pipe is closed now: the thread reads to its end
            os.close(read_fd)
        if console_handler is not None:
            root.removeHandler(console_handler)
        os.close(log_fd)
        _put_log_in_place(tmp_log, log_path, refused, failed and not verbose, console_err)
        console_out.close()
        console_err.close()
