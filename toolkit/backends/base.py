"""The interface every backend offers, and the job status they all report.

A backend submits a rendered job script, reports the state of its jobs in one
vocabulary (Slurm's, normalized) and cancels them. The controller never needs to
know which backend it talks to.
"""

from __future__ import annotations

import abc
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Mapping

# Normalized job states (Slurm's names). A backend maps whatever it sees onto these.
PENDING, RUNNING, COMPLETING, COMPLETED = "PENDING", "RUNNING", "COMPLETING", "COMPLETED"
FAILED, OUT_OF_MEMORY, TIMEOUT, CANCELLED = "FAILED", "OUT_OF_MEMORY", "TIMEOUT", "CANCELLED"
NODE_FAIL, PREEMPTED, BOOT_FAIL, DEADLINE = "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE"
UNKNOWN = "UNKNOWN"

STATES = (
    PENDING, RUNNING, COMPLETING, COMPLETED, FAILED, OUT_OF_MEMORY, TIMEOUT,
    CANCELLED, NODE_FAIL, PREEMPTED, BOOT_FAIL, DEADLINE, UNKNOWN,
)
ACTIVE_STATES = frozenset({PENDING, RUNNING, COMPLETING})
"""The job may still run: poll again."""
FINISHED_STATES = frozenset(STATES) - ACTIVE_STATES - {UNKNOWN}
"""The job is over for good. UNKNOWN is in neither set: the caller decides what it means."""


@dataclass(frozen=True)
class JobStatus:
    """One job as its backend last saw it (times in seconds, memory in MiB)."""

    job_id: str
    state: str
    """One of ``STATES``."""
    exit_code: int | None = None
    """Exit code of the job script; None until the job has finished (or when unknown)."""
    signal: int | None = None
    """Signal that ended the job script (Slurm's ``code:signal``); 0 when none, None when unknown."""
    elapsed_s: float | None = None
    """Wall-clock time the job has run so far."""
    max_rss_mib: float | None = None
    """Largest resident set size of any process (step) of the job, when the backend measures it."""
    node: str | None = None
    """Node(s) the job ran on."""
    reason: str | None = None
    """The scheduler's reason (pending reason, who cancelled, why the record is missing)."""
    raw: str = ""
    """The backend's own record for the job (sacct/squeue/scontrol lines, the local result JSON)."""

    def __post_init__(self):
        if self.state not in STATES:
            raise ValueError(f"state must be one of {', '.join(STATES)}; got {self.state!r}")

    @property
    def finished(self) -> bool:
        """The job is over (whatever the outcome); UNKNOWN is not finished."""
        return self.state in FINISHED_STATES

    @property
    def succeeded(self) -> bool:
        """The job completed with exit code 0 and no signal."""
        return self.state == COMPLETED and self.exit_code in (0, None) and not self.signal

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "JobStatus":
        return cls(**data)


class Backend(abc.ABC):
    """Submits rendered job scripts, reports their state, cancels them."""

    name: ClassVar[str]

    @abc.abstractmethod
    def submit(self, script: Path, attempt_dir: Path) -> str:
        """Submit ``script`` (its directives say what it needs) and return the job id.

        The job's output goes to ``log_path(attempt_dir, job_id)``. Raises
        ``SchedulerError`` with the scheduler's own message when the job is refused.
        """

    @abc.abstractmethod
    def poll(self, job_ids: list[str]) -> dict[str, JobStatus]:
        """The status of every id in ``job_ids`` (one batched query); unknown ids get UNKNOWN."""

    @abc.abstractmethod
    def cancel(self, job_ids: list[str]) -> None:
        """Cancel the jobs; ids that already finished are ignored."""

    @abc.abstractmethod
    def test_only(self, script: Path) -> str:
        """Check that ``script`` would be accepted without running it; return the backend's message."""

    @abc.abstractmethod
    def find(self, job_name: str, attempt_dir: Path) -> str | None:
        """The id of a job already submitted for ``attempt_dir`` under ``job_name``, or None.

        Lets a controller that died between sbatch and recording the id find the job
        instead of submitting it twice.
        """

    @staticmethod
    def log_path(attempt_dir: Path, job_id: str) -> Path:
        """Where the job's stdout and stderr go (the templates use ``slurm-%j.out``)."""
        return Path(attempt_dir) / f"slurm-{job_id}.out"
