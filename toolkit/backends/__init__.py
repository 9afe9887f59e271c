"""Backends: where a rendered job script runs. ``slurm`` (sbatch/sacct) and ``local`` (this machine).

Both offer the whole of ``base.Backend``: ``submit``, ``poll``, ``cancel``, ``test_only``, ``find``
and the accounting queries triage makes (``job_facts``, ``failed_jobs``, ``batch_scripts``,
``controller_facts``), and report ``JobStatus`` values in one state vocabulary. Callers use the
interface, never a backend's class: build one with ``get_backend``.
"""

from __future__ import annotations

from ..errors import UnknownNameError
from .base import FAULT_POINTS, FINISHED_STATES, STATES, Backend, JobStatus, fault
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


__all__ = ["BACKENDS", "Backend", "FAULT_POINTS", "FINISHED_STATES", "JobStatus", "LocalBackend", "STATES",
           "SlurmBackend", "fault", "get_backend"]
