"""``hpcmem submit --detach``: hand a run's controller loop to a job that outlives the login session.

On a Slurm site the loop is a small CPU job submitted with submitit; it is
requeued by submitit on its time limit (``checkpoint``) and simply carries on,
because the controller's state is all in the ledger. On the local site it is a
detached ``hpcmem watch`` process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from . import proc, runs
from .errors import SchedulerError
from .ledger import Run
from .resources import env_number
from .sites import Site

MIN_CONTROLLER_TIME_MIN = 2
"""The shortest controller time limit under which its warning can be placed after its start (``signal_delay_s``)."""

SLURM_SIGNAL_EARLY_S = 60
"""sbatch(1), ``--signal``: "Due to the resolution of event handling by Slurm, the signal may be sent up to 60
seconds earlier than specified" (slurmctld sends it once the end is within the delay plus its 30 s period)."""
HANDLER_START_S = 30
"""Left between the controller's start and the earliest warning: submitit installs its USR2 handler only once
its Python is up, and a warning before that kills the controller instead of requeueing it."""


def controller_time_min() -> int:
    """The controller job's time limit in minutes before submitit requeues it (capped by the partition):
    ``$HPCMEM_CONTROLLER_TIME_MIN``, a day by default, at least ``MIN_CONTROLLER_TIME_MIN``."""
    return int(env_number("HPCMEM_CONTROLLER_TIME_MIN", 24 * 60, minimum=MIN_CONTROLLER_TIME_MIN, integer=True))


def signal_delay_s(limit_min: int) -> int:
    """How long before its limit of ``limit_min`` minutes the controller job asks to be warned (and requeues
    itself): 90 s, less under a short limit so that Slurm's earliest warning still comes ``HANDLER_START_S``
    after the start; at least 1 s."""
    return max(1, min(90, limit_min * 60 - SLURM_SIGNAL_EARLY_S - HANDLER_START_S))


class Follower:
    """The controller loop as a submitit job: ticks the run until it ends; requeued on timeout."""

    def __init__(self, run_id: str, home: str, interval_s: float = 10.0):
        self.run_id, self.home, self.interval_s = run_id, home, interval_s

    def __call__(self) -> str:
        from . import controller

        os.environ["HPCMEM_HOME"] = self.home
        with runs.open_ledger(Path(self.home)) as ledger:
            return controller.follow(ledger, self.run_id, interval_s=self.interval_s).state

    def checkpoint(self):
        """Called by submitit before the time limit: requeue the same loop (the ledger holds the state)."""
        import submitit

        return submitit.helpers.DelayedSubmission(Follower(self.run_id, self.home, self.interval_s))


def detach(run: Run, site: Site, home: Path) -> str:
    """Start the controller loop for ``run`` away from this process; returns its job id or pid."""
    if site.scheduler == "local":
        log = Path(run.run_dir) / "controller.log"
        pid = proc.spawn_detached([sys.executable, "-m", "toolkit.cli", "watch", run.run_id, "--quiet"],
                                  env={**os.environ, "HPCMEM_HOME": str(home)}, cwd=run.workdir, stdout_path=log)
        return f"pid {pid}"
    import submitit

    partition = site.partition(run.partition)
    executor = submitit.AutoExecutor(folder=str(Path(run.run_dir) / "controller"), cluster="slurm")
    limit_min = min(controller_time_min(), partition.max_time_min)
    params = {"slurm_partition": partition.slurm_partition, "timeout_min": limit_min,
              "cpus_per_task": 1, "slurm_mem": "1G", "name": f"hpcmem-controller.{run.run_id}",
              "slurm_signal_delay_s": signal_delay_s(limit_min)}
    if partition.account:
        params["slurm_account"] = partition.account
    if partition.qos:
        params["slurm_qos"] = partition.qos
    executor.update_parameters(**params)
    env = {k: v for k, v in os.environ.items() if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    for key in env:  # a nested sbatch would inherit the calling job's settings
        os.environ.pop(key)
    try:
        job = executor.submit(Follower(run.run_id, str(home)))
    except Exception as exc:  # submitit raises its own errors with sbatch's message
        raise SchedulerError(f"could not submit the controller job: {str(exc).strip().splitlines()[-1]}") from exc
    finally:
        os.environ.update(env)
    return str(job.job_id)
