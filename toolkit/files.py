"""Files: atomic writes (a reader sees the old content or the new, never half of it) and bounded reads.

``write_atomic`` is the one writer for everything hpcmem writes that someone else may read at the same moment:
attempt files (plan.json, job.sbatch), the local backend's records, calibration files, metrics.json,
bench manifests and reports. ``read_small_text``/``read_small_json`` are the readers of small files someone
else wrote (specs, sites, model configs, DeepSpeed configs, run records): regular files only, never waited
on, bounded in size and nesting, any problem one ConfigError line.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from .errors import ConfigError

MAX_SMALL_BYTES = 4 * 2**20
"""Default limit of ``read_small_text``: specs, sites and calibration files are a few KiB."""


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` through a synced temporary file in the same
    directory and ``os.replace``; the temporary file is removed if anything fails. Returns the path."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _mode())  # mkstemp's 0600 would hide reports and job files from the group
        with os.fdopen(fd, "wb") as out:
            out.write(data.encode() if isinstance(data, str) else data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def _mode() -> int:
    """0666 less the process umask: the mode a plain ``open(path, "w")`` would give."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def read_small_text(path: Path, what: str = "", limit: int = MAX_SMALL_BYTES) -> str:
    """A small UTF-8 text file: a regular file (never a FIFO or device: opened without blocking, checked before
    reading) of at most ``limit`` bytes. Anything else is a one-line ConfigError naming the file."""
    label = f"{what} {path}" if what else str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read: {exc.strerror or exc}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{label}: not a regular file")
        if info.st_size > limit:
            raise ConfigError(f"{label}: {info.st_size} bytes, more than the {limit} such a file can be")
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 2**20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise ConfigError(f"{label}: more than the {limit} bytes such a file can be")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{label}: not UTF-8 text (byte {exc.start}, line {line})") from None


def read_small_json(path: Path, what: str = "", limit: int = MAX_SMALL_BYTES) -> Any:
    """A small JSON file read as ``read_small_text`` reads it; invalid or too deeply nested JSON is a one-line
    ConfigError naming the file."""
    label = f"{what} {path}" if what else str(path)
    text = read_small_text(Path(path), what, limit)
    try:
        return json.loads(text)
    except ValueError as exc:  # also Python's limit on an integer's digits
        raise ConfigError(f"{label}: not valid JSON: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{label}: not valid JSON: nested too deeply") from None
