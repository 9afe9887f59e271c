"""The one place where hpcmem runs other programs.

Every command is a list of arguments (never a shell line), runs with a timeout in
its own process group (so a timeout or Ctrl-C takes its children down too), and
fails with a ``CommandError`` that carries argv, exit code, stdout and stderr.

Two ways to start a program:

- ``run``: run it to the end and collect its output (sbatch, sacct, bash -n ...).
- ``spawn_detached``: start it in a new session with its output going to a file and
  return its pid; it outlives the caller (the local backend's jobs).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from .errors import CommandError

# After a timeout the group gets SIGTERM, then SIGKILL this many seconds later.
_TERM_GRACE_S = 2.0


@dataclass(frozen=True)
class Completed:
    """A finished command: its argv, exit status and decoded output."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str


class CommandNotFoundError(CommandError):
    """The program to run does not exist (not on PATH, or no such file)."""

    def __init__(self, argv: Sequence[str]):
        super().__init__(argv, 127, message=f"command not found: {argv[0]}")


class CommandTimeoutError(CommandError):
    """The program ran past its timeout and was killed (with its process group)."""

    def __init__(self, argv: Sequence[str], timeout: float, stdout: str = "", stderr: str = ""):
        super().__init__(argv, None, stdout, stderr, message=f"{argv[0]} timed out after {timeout:g} s and was killed")
        self.timeout = timeout


def run(
    argv: Sequence[str | os.PathLike],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    check: bool = True,
    input: str | None = None,
) -> Completed:
    """Run ``argv`` to the end and return its exit status and output.

    ``timeout`` is in seconds; past it the command's whole process group is killed and
    ``CommandTimeoutError`` is raised. ``env`` replaces the environment (None: inherit).
    ``input`` is written to stdin (otherwise stdin is /dev/null, so nothing ever waits
    on the terminal). With ``check`` a non-zero exit raises ``CommandError``.
    A program that does not exist raises ``CommandNotFoundError``.
    """
    argv = _argv(argv)
    try:
        child = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=None if env is None else dict(env),
            cwd=cwd,
            text=True,
            encoding="utf-8",
            errors="replace",
            start_new_session=True,
        )
    except FileNotFoundError as exc:
        raise _start_error(argv, cwd, exc) from exc
    except PermissionError as exc:
        raise CommandError(argv, 126, message=f"cannot execute {argv[0]}: permission denied") from exc
    try:
        stdout, stderr = child.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = _stop(child)
        raise CommandTimeoutError(argv, timeout, stdout, stderr) from None
    except BaseException:  # Ctrl-C or anything else: leave no orphans behind
        _stop(child)
        raise
    done = Completed(argv, child.returncode, stdout or "", stderr or "")
    if check and done.returncode != 0:
        raise CommandError(argv, done.returncode, done.stdout, done.stderr)
    return done


def spawn_detached(
    argv: Sequence[str | os.PathLike],
    *,
    env: Mapping[str, str] | None,
    cwd: str | os.PathLike,
    stdout_path: str | os.PathLike,
    address_space_mib: int | None = None,
) -> int:
    """Start ``argv`` in a new session and return its pid without waiting for it.

    stdout and stderr are appended to ``stdout_path``; stdin is /dev/null. The new
    session makes the child the leader of its own process group (pgid == pid), so
    ``os.killpg(pid, ...)`` reaches everything it starts, and it outlives the caller.
    ``address_space_mib`` sets RLIMIT_AS (soft and hard) on the child, inherited by all
    its descendants. The limit is set between fork and exec, which is only safe from a
    single-threaded caller (the local runner is one).

    The caller may wait for the child itself (``os.waitpid``); a caller that does not
    should call ``reap_detached`` now and then so finished children leave no zombies.
    """
    argv = _argv(argv)
    limit = None if address_space_mib is None else _address_space_limit(address_space_mib)
    with open(stdout_path, "ab") as out:
        try:
            child = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=None if env is None else dict(env),
                cwd=cwd,
                start_new_session=True,
                preexec_fn=limit,
            )
        except FileNotFoundError as exc:
            raise _start_error(argv, cwd, exc) from exc
        except PermissionError as exc:
            raise CommandError(argv, 126, message=f"cannot execute {argv[0]}: permission denied") from exc
    # Keep the Popen alive: dropped, it would warn "still running" and be reaped by the
    # next Popen, stealing the exit status from a caller that waits with os.waitpid.
    _DETACHED[child.pid] = child
    return child.pid


def reap_detached() -> None:
    """Collect the exit status of finished detached children (never blocks)."""
    for pid, child in list(_DETACHED.items()):
        try:
            if child.poll() is not None:
                del _DETACHED[pid]
        except ChildProcessError:  # already waited for by its owner
            del _DETACHED[pid]


_DETACHED: dict[int, subprocess.Popen] = {}


def _argv(argv) -> list[str]:
    if isinstance(argv, (str, bytes)):
        raise TypeError(f"argv must be a list of arguments, not a string: {argv!r}")
    out = []
    for arg in argv:
        if not isinstance(arg, (str, os.PathLike)):
            raise TypeError(f"argv elements must be str or path, got {type(arg).__name__}: {arg!r}")
        out.append(os.fspath(arg))
    if not out:
        raise ValueError("argv is empty")
    return out


def _start_error(argv: list[str], cwd, exc: FileNotFoundError) -> CommandError:
    if cwd is not None and not Path(cwd).is_dir():
        return CommandError(argv, 127, message=f"cannot run {argv[0]}: working directory {os.fspath(cwd)} does not exist")
    return CommandNotFoundError(argv)


def _stop(child: subprocess.Popen) -> tuple[str, str]:
    """Terminate the child's process group, then kill it; return what it printed."""
    for sig, wait_s in ((signal.SIGTERM, _TERM_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(child.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            return child.communicate(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    # A grandchild that left the group still holds the pipes: give up on the output.
    child.kill()
    child.wait()
    return "", ""


def _address_space_limit(mib: int):
    if mib < 1:
        raise ValueError(f"address_space_mib must be positive, got {mib}")
    wanted = mib * 1024 * 1024

    def apply() -> None:  # runs in the child between fork and exec
        _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        cap = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    return apply
