"""Runs one local job to its end and records how it ended: ``python -m toolkit.backends.local_runner``.

The local backend starts this runner detached (its own session, outliving the
caller). The runner starts ``bash SCRIPT`` in a process group of its own, with the
job's memory cap as RLIMIT_AS, then watches it:

- the script ends: COMPLETED on exit 0, FAILED otherwise;
- the time limit passes: SIGTERM to the job's group, SIGKILL ``kill_wait_s`` later, TIMEOUT;
- a cancel (SIGTERM to the runner or a ``<id>.cancel`` file): the same, CANCELLED.

Like slurmstepd it kills whatever the script left running, notes a cancellation
or time limit in the log in Slurm's words, and finally writes
``<attempt_dir>/<id>.json`` (``local-<n>.json``) atomically: state, exit code, signal, start, end,
elapsed seconds and peak RSS (MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from .. import proc
from ..errors import CommandError
from .base import CANCELLED, COMPLETED, FAILED, TIMEOUT, fault
from ..files import write_atomic
from .local import _start_ticks, cancel_path, now_iso, pid_path, result_path, take_claim

_TICK_S = 0.1


def stop_line(job_id: str, why: str) -> str:
    """The line slurmstepd prints when it stops a job (the classifier reads it)."""
    suffix = " DUE TO TIME LIMIT" if why == TIMEOUT else ""
    return f"local-runner: error: *** JOB {job_id} ON localhost CANCELLED AT {now_iso()}{suffix} ***"


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    attempt_dir = Path(args.attempt_dir)
    asked_to_stop = []
    # A Python handler, not SIG_IGN: handlers reset to default on exec, so the job's
    # own processes still die of SIGTERM.
    signal.signal(signal.SIGTERM, lambda *_: asked_to_stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: asked_to_stop.append(1))
    signal.signal(signal.SIGHUP, lambda *_: None)

    fault("runner_start")
    if args.claim:  # exactly one of this runner and a later "nobody started it" decides
        claim = take_claim(Path(args.claim), {"by": "runner", "pid": os.getpid(), "start": _start_ticks(os.getpid())})
        if claim.get("by") != "runner" or claim.get("pid") != os.getpid():
            print(f"local-runner: job {args.job_id} was given up before this runner started "
                  f"({claim.get('reason', 'abandoned')}); not running it", flush=True)
            return 0
    fault("runner_after_claim")

    start = time.time()
    try:
        pid = proc.spawn_detached(
            ["bash", args.script], env=None, cwd=args.cwd, stdout_path=args.log, address_space_mib=args.mem_mib,
        )
    except CommandError as exc:
        print(f"local-runner: error: {exc}", flush=True)
        _record(args, start, FAILED, None, None, 0.0, str(exc))
        return 1
    write_atomic(pid_path(attempt_dir, args.job_id), f"{pid}\n")
    fault("runner_after_job_spawn")

    stopping, kill_at = None, None
    while True:
        waited, status, usage = os.wait4(pid, os.WNOHANG)
        if waited:
            break
        now = time.time()
        if stopping is None:
            if asked_to_stop or cancel_path(attempt_dir, args.job_id).exists():
                stopping = CANCELLED
            elif args.time_limit_s and now - start > args.time_limit_s:
                stopping = TIMEOUT
            if stopping:
                print(stop_line(args.job_id, stopping), flush=True)
                _signal_group(pid, signal.SIGTERM)
                kill_at = now + args.kill_wait_s
        elif kill_at is not None and now >= kill_at:
            _signal_group(pid, signal.SIGKILL)
            kill_at = None
        time.sleep(_TICK_S)
    _signal_group(pid, signal.SIGKILL)  # what the script left running dies with it, as under Slurm

    if os.WIFEXITED(status):
        code, sig = os.WEXITSTATUS(status), 0
    else:  # Slurm's convention for a script killed by a signal: ExitCode 0:<signal>
        code, sig = 0, os.WTERMSIG(status)
    if stopping:
        state, reason = stopping, ("time limit reached" if stopping == TIMEOUT else "cancelled")
    elif code == 0 and sig == 0:
        state, reason = COMPLETED, None
    else:
        state = FAILED
        reason = f"exit code {code}" if sig == 0 else f"killed by signal {sig} ({signal.Signals(sig).name})"
    _record(args, start, state, code, sig, usage.ru_maxrss / 1024, reason)
    return 0


def _record(args, start: float, state: str, code, sig, max_rss_mib: float, reason: str | None) -> None:
    end = time.time()
    result = {
        "job_id": args.job_id, "state": state, "exit_code": code, "signal": sig,
        "start": now_iso(start), "end": now_iso(end), "elapsed_s": round(end - start, 3),
        "max_rss_mib": round(max_rss_mib, 1), "reason": reason, "node": "localhost",
        "mem_cap_mib": args.mem_mib, "time_limit_s": args.time_limit_s,
    }
    write_atomic(result_path(Path(args.attempt_dir), args.job_id), json.dumps(result, indent=2) + "\n")


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m toolkit.backends.local_runner", description=__doc__.splitlines()[0])
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--script", required=True)
    parser.add_argument("--attempt-dir", required=True)
    parser.add_argument("--cwd", required=True, help="the job's working directory")
    parser.add_argument("--log", required=True, help="file the job's stdout and stderr are appended to")
    parser.add_argument("--mem-mib", type=int, default=None, help="RLIMIT_AS of the job's processes")
    parser.add_argument("--time-limit-s", type=float, default=None)
    parser.add_argument("--kill-wait-s", type=float, default=5.0, help="SIGTERM to SIGKILL grace")
    parser.add_argument("--claim", default=None, help="claim file: the runner starts the job only if it creates it")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
