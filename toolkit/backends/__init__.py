"""Backends: where a rendered job script runs. ``slurm`` (sbatch/sacct) and ``local`` (this machine).

Both offer ``submit``, ``poll``, ``cancel`` and ``test_only`` (see ``base.Backend``) and
report ``JobStatus`` values in one state vocabulary.
"""

from __future__ import annotations

from ..errors import UnknownNameError
from .base import FINISHED_STATES, STATES, Backend, JobStatus
from .local import LocalBackend
from .slurm import SlurmBackend

BACKENDS: dict[str, type[Backend]] = {"slurm": SlurmBackend, "local": LocalBackend}


def get_backend(name: str, **options) -> Backend:
    """The backend called ``name`` (``slurm`` or ``local``), built with ``options``
    (e.g. ``tries=``, ``backoff_s=`` for slurm; ``default_mem_mib=``, ``state_dir=`` for local)."""
    try:
        cls = BACKENDS[name]
    except KeyError:
        raise UnknownNameError("backend", name, BACKENDS) from None
    return cls(**options)


__all__ = ["BACKENDS", "Backend", "FINISHED_STATES", "JobStatus", "LocalBackend", "STATES", "SlurmBackend", "get_backend"]
