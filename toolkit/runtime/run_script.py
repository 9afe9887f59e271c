"""Run a user's training script as ``python SCRIPT ARGS...`` would, then tear torch.distributed down cleanly.

    python /path/to/toolkit/runtime/run_script.py SCRIPT [ARGS...]
    python -m toolkit.runtime.run_script SCRIPT [ARGS...]

The rendered job starts a user's script (``command.script``) through this file, under every launcher. The script
runs with the semantics of ``python SCRIPT``: ``__name__ == "__main__"``, ``__file__`` its absolute path,
``sys.argv == [SCRIPT, *ARGS]``, its directory first on ``sys.path``; its exit status and an uncaught exception
(traceback, exit 1) are Python's own, because they pass through unchanged.

Why: a script that never calls ``torch.distributed.destroy_process_group()`` (most HF Trainer scripts do not)
leaves the process group's worker threads (gloo's ``pt_gloo_runloop`` and ``gloo_tcp_loop``, NCCL's watchdog) alive
into interpreter finalization. When one of them still holds work when the interpreter shuts down, releasing its
tensors needs the GIL, the finalizing interpreter ends that thread with ``pthread_exit``, and the C++ runtime
aborts: ``terminate called without an active exception``, SIGABRT, exit -6 -- after the final metrics were
printed (docs/triage.md, cause ``teardown``).

What it adds, only when the script ended normally (returned, or ``sys.exit(0)``) and had initialised
torch.distributed: at exit (after the script's own ``atexit`` handlers, before finalization), a barrier (every
rank's work finished) and ``destroy_process_group()``, in a helper thread bounded by ``HPCMEM_TEARDOWN_TIMEOUT_S``
(default 120 s). Destroying a group joins its threads only when nothing else holds it; gloo's ``shutdown`` does not
stop them (torch 2.13), and DeepSpeed keeps its groups (``deepspeed.utils.groups._WORLD_GROUP``, each parameter's
``_dp_group``, the ZeRO optimizer's ``dp_process_group``) to the end. So when such threads are still alive after the
teardown, or the bound passed (a peer died, a collective hangs), the process ends with the script's status (0)
through ``os._exit`` after flushing its output and every open file, skipping the finalization that could abort on
them; otherwise Python finalizes as usual. After a failure nothing is added: the script ends exactly as it would
have.

This file imports nothing from hpcmem and torch only when the script already did, so it runs under any
interpreter a job spec names (``command.python``), with or without hpcmem installed there.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import threading
import time

TIMEOUT_ENV = "HPCMEM_TEARDOWN_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 120.0
COMM_THREADS = ("pt_gloo", "gloo_", "pt_nccl", "pt_tcpstore")
"""Name prefixes of the native threads torch.distributed's backends start (gloo's pt_gloo_runloop and
gloo_tcp_loop, NCCL's watchdog and heartbeat, the TCPStore's loop)."""


class _Outcome:
    """How the script ended: ``clean`` once it returned or called ``sys.exit`` with status 0 / None."""

    clean = False


def timeout_s(environ=os.environ) -> float:
    """The teardown's bound in seconds (``HPCMEM_TEARDOWN_TIMEOUT_S``; a bad value: the default, said once)."""
    text = environ.get(TIMEOUT_ENV, "")
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        print(f"hpcmem: {TIMEOUT_ENV}={text[:40]!r} is not a positive number of seconds; using "
              f"{DEFAULT_TIMEOUT_S:g}", file=sys.stderr, flush=True)
        return DEFAULT_TIMEOUT_S
    return value


def clean_teardown(timeout: float) -> str:
    """Barrier, then ``destroy_process_group()``, when torch.distributed is initialised; at most ``timeout`` s.

    Returns what happened: ``"none"`` (torch.distributed never imported or not initialised), ``"destroyed"``,
    ``"destroyed, barrier failed: ..."`` (a peer gone: the group is still destroyed locally), ``"failed: ..."``
    or ``"timed out"`` (the helper thread is left behind, a daemon)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return "none"
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return "none"
    except Exception as exc:  # noqa: BLE001 - a half-torn-down torch must not turn a success into a failure
        return f"failed: {type(exc).__name__}: {exc}"
    result: list[str] = []

    def work() -> None:
        barrier = ""
        try:
            dist.barrier()
        except Exception as exc:  # noqa: BLE001 - a peer that already left; destroying locally is still right
            barrier = f", barrier failed: {type(exc).__name__}: {str(exc)[:200]}"
        try:
            dist.destroy_process_group()
            import gc

            gc.collect()  # a group held only by reference cycles is freed now, its threads joined
            result.append("destroyed" + barrier)
        except Exception as exc:  # noqa: BLE001
            result.append(f"failed: {type(exc).__name__}: {str(exc)[:200]}")

    helper = threading.Thread(target=work, name="hpcmem-teardown", daemon=True)
    helper.start()
    helper.join(timeout)
    return result[0] if result else "timed out"


def _at_exit(outcome: _Outcome) -> None:
    """Registered before the script runs, so it runs after every handler the script registered."""
    if not outcome.clean:
        return
    limit = timeout_s()
    started = time.monotonic()
    what = clean_teardown(limit)
    if what == "none":
        return
    if what == "timed out" or what.startswith("failed"):
        print(f"hpcmem: torch.distributed teardown {what} after {time.monotonic() - started:.0f} s (bound {limit:g} s); "
              "the script had finished, exiting with its status 0 without interpreter finalization",
              file=sys.stderr, flush=True)
        _exit_now(0)
    held = comm_threads()
    if held is None or held:
        names = ", ".join(sorted(set(held))) if held else "unknown (no /proc/self/task)"
        print(f"hpcmem: process groups destroyed, but {len(held) if held else 'some'} communication thread(s) are still "
              f"held by the training libraries ({names}): exiting with status 0, skipping interpreter finalization "
              "(docs/triage.md, teardown)", file=sys.stderr, flush=True)
        _exit_now(0)


def comm_threads(task_dir: str = "/proc/self/task") -> list[str] | None:
    """Names of this process's live torch.distributed backend threads (``COMM_THREADS``); None when unknown."""
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    names = []
    for tid in tids:
        try:
            with open(os.path.join(task_dir, tid, "comm")) as f:
                name = f.read().strip()
        except OSError:
            continue  # the thread ended meanwhile
        if name.startswith(COMM_THREADS):
            names.append(name)
    return names


def _exit_now(status: int) -> None:
    """``os._exit(status)`` after flushing stdout, stderr and every open file (finalization would have)."""
    import gc
    import io

    for obj in gc.get_objects():
        try:
            if issubclass(type(obj), io.IOBase) and not obj.closed and obj.writable():
                obj.flush()
        except Exception:  # noqa: BLE001 - a broken or closed stream must not stop the exit
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(status)


def run(script: str, args: list[str]) -> None:
    """Run ``script`` as ``__main__`` with ``sys.argv = [script, *args]``; exceptions and SystemExit propagate."""
    path = os.path.abspath(script)
    if not os.path.isfile(path):
        print(f"hpcmem: {script}: no such script", file=sys.stderr, flush=True)
        raise SystemExit(2)
    sys.argv = [path, *args]
    # `python SCRIPT` puts the script's directory first on sys.path (the real one, symlinks resolved), in place
    # of this file's (or, under -m, the working directory)
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    outcome = _Outcome()
    atexit.register(_at_exit, outcome)
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        outcome.clean = exc.code is None or exc.code == 0
        raise
    outcome.clean = True


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[1] if argv else "usage: run_script.py SCRIPT [ARGS...]",
              file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    run(argv[0], argv[1:])


if __name__ == "__main__":
    main()
