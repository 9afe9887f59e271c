"""Atomic file writes: a reader sees the old content or the new, never half of it.

The one writer for everything hpcmem writes that someone else may read at the same moment:
attempt files (plan.json, job.sbatch), the local backend's records, calibration files, metrics.json,
bench manifests and reports.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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
