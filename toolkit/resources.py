"""Where the shipped data lives: ``templates/``, ``site_configs/``, ``jobs/``.

In a source checkout (and an editable install) they sit beside ``toolkit/``.
A wheel carries copies inside the package as ``toolkit/_data/<name>/`` (see
setup.py), so a non-editable install finds them there.
"""

from __future__ import annotations

import os
from pathlib import Path

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
