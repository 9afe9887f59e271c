"""The interface every backend offers, and the job status they all report.

A backend submits a rendered job script, reports the state of its jobs in one
vocabulary (Slurm's, normalized) and cancels them. The controller never needs to
know which backend it talks to.
"""

from __future__ import annotations

import abc
import os
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, TypeVar

from ..errors import CommandError

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


FAULT_POINTS = (
    # the controller (toolkit/controller.py)
    "after_plan", "before_render", "after_render", "before_sbatch", "after_sbatch", "after_poll", "after_decide",
    # the local backend's submit (toolkit/backends/local.py)
    "local_after_id", "local_after_record", "local_after_spawn",
    # the local runner (toolkit/backends/local_runner.py)
    "runner_start", "runner_after_claim", "runner_after_job_spawn",
)
"""Every named crash point of the submit path, in the order a submission passes them."""


def fault(point: str) -> None:
    """Die here (SIGKILL) when ``HPCMEM_FAULT`` names this point: how the crash-safety tests kill hpcmem.

    ``HPCMEM_FAULT`` holds one point of ``FAULT_POINTS``. The runner's points are reached in the local
    runner process (it inherits the variable), the others in the submitting process.
    """
    if os.environ.get("HPCMEM_FAULT") == point:
        os.kill(os.getpid(), signal.SIGKILL)


RETRY = object()
"""What a ``retrying`` judge returns to ask for another try."""

T = TypeVar("T")


def retrying(call: Callable[[], T], judge: Callable[[CommandError, bool], Any], *, tries: int,
             pause: Callable[[int], None]) -> T:
    """The one retry loop of the backends: ``call()`` up to ``tries`` times.

    A ``CommandError`` from ``call`` goes to ``judge(error, last_try)``, which raises, returns the value
    to give back instead, or returns ``RETRY``; between tries ``pause(n)`` (n = 1, 2 ...) waits. On the
    last try ``RETRY`` re-raises the error. A command that is not installed is never retried.
    """
    from ..proc import CommandNotFoundError

    for attempt in range(1, tries + 1):
        try:
            return call()
        except CommandNotFoundError:
            raise
        except CommandError as exc:
            outcome = judge(exc, attempt == tries)
            if outcome is not RETRY:
                return outcome
            if attempt == tries:
                raise
            pause(attempt)
    raise AssertionError("unreachable")


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

    # -- accounting: what triage asks about jobs that may not be hpcmem's

    @abc.abstractmethod
    def job_facts(self, job_ids: list[str]) -> dict[str, dict]:
        """Everything the backend's accounting knows of the jobs, in one query, keyed by job id.

        Each value has the keys of ``slurm.parse_sacct_facts`` (job_id, raw_id, array_job_id,
        array_task_id, name, user, partition, cluster, state, state_text, exit_code, signal,
        elapsed_s, timelimit_s, max_rss_mib, req_tres, alloc_tres, nodes, workdir, submit, start, end,
        reason, steps). An unknown id is absent. Raises ``SchedulerError`` when the backend keeps no
        accounting it can read (say why).
        """

    @abc.abstractmethod
    def failed_jobs(self, start_s: float, end_s: float, *, partition: str | None = None,
                    user: str | None = None) -> dict[str, dict]:
        """Facts (as ``job_facts``) of every job that ended badly between ``start_s`` and ``end_s``
        (unix seconds); errors as ``job_facts``."""

    @abc.abstractmethod
    def batch_scripts(self, job_ids: list[str]) -> dict[str, str]:
        """The job scripts as submitted, by job id; jobs whose script was not kept are absent."""

    @abc.abstractmethod
    def controller_facts(self, job_ids: list[str]) -> dict[str, dict]:
        """What the scheduler still remembers of the jobs: the keys of ``job_facts`` (no steps, no MaxRSS)
        plus ``stdout``, ``stderr`` and ``command`` (paths). Unknown or forgotten ids are absent."""

    @staticmethod
    def log_path(attempt_dir: Path, job_id: str) -> Path:
        """Where the job's stdout and stderr go (the templates use ``slurm-%j.out``)."""
        return Path(attempt_dir) / f"slurm-{job_id}.out"
