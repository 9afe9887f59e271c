"""Where the shipped data lives: ``templates/``, ``site_configs/``, ``jobs/``.

In a source checkout (and an editable install) they sit beside ``toolkit/``.
A wheel carries copies inside the package as ``toolkit/_data/<name>/`` (see
setup.py), so a non-editable install finds them there.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from .errors import ConfigError

_PACKAGE = Path(__file__).resolve().parent
DATA_DIRS = ("templates", "site_configs", "jobs")


def data_dir(name: str) -> Path:
    """The directory of shipped ``templates``, ``site_configs`` or ``jobs``."""
    if name not in DATA_DIRS:
        raise ValueError(f"unknown data directory {name!r}")
    installed = _PACKAGE / "_data" / name
    if installed.is_dir():
        return installed
    return _PACKAGE.parent / name


def home_dir() -> Path:
    """Where hpcmem keeps its state: ``$HPCMEM_HOME`` or ``~/.hpcmem``."""
    return Path(os.environ.get("HPCMEM_HOME") or Path.home() / ".hpcmem").expanduser()


def env_number(name: str, default: float, *, minimum: float = 0.0, integer: bool = False) -> float:
    """The number set in environment variable ``name`` (``default`` when unset or empty), read when it is
    needed so that a bad value is a one-line ``ConfigError`` naming the variable, never an import-time crash."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
        ok = math.isfinite(value) and value >= minimum
    except (ValueError, OverflowError):  # OverflowError: a whole number too large for a float
        ok = False
    if not ok:
        kind = "a whole number" if integer else "a number"
        shown = raw if len(raw) <= 40 else raw[:40] + "..."
        raise ConfigError(f"environment variable {name}={shown!r} is not {kind} of at least {minimum:g}")
    return value
