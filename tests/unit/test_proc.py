"""toolkit.proc on real commands."""

import os
import signal
import sys
import time

import pytest

from toolkit import proc
from toolkit.errors import CommandError, HpcmemError


def test_true():
    done = proc.run(["true"], timeout=10)
    assert done == proc.Completed(["true"], 0, "", "")


def test_false_raises_with_argv_and_code():
    with pytest.raises(CommandError) as info:
        proc.run(["false"], timeout=10)
    assert info.value.argv == ["false"]
    assert info.value.returncode == 1
    assert str(info.value) == "false failed (exit 1)"


def test_failure_carries_stdout_and_stderr():
    script = "echo out; echo 'first problem' >&2; echo 'last problem' >&2; exit 4"
    with pytest.raises(CommandError) as info:
        proc.run(["bash", "-c", script], timeout=10)
    err = info.value
    assert (err.returncode, err.stdout, err.stderr) == (4, "out\n", "first problem\nlast problem\n")
    assert str(err) == "bash failed (exit 4): last problem"
    assert isinstance(err, HpcmemError)


def test_check_false_returns_the_failure():
    done = proc.run(["bash", "-c", "echo a; echo b >&2; exit 3"], timeout=10, check=False)
    assert (done.returncode, done.stdout, done.stderr) == (3, "a\n", "b\n")


def test_arguments_reach_the_program_verbatim():
    hostile = ["a b", "$(touch /tmp/pwned)", "'; rm -rf /", "*", "--flag=x y"]
    done = proc.run([sys.executable, "-c", "import sys, json; print(json.dumps(sys.argv[1:]))", *hostile], timeout=30)
    assert done.stdout.strip() == __import__("json").dumps(hostile)


def test_env_cwd_and_input(tmp_path):
    done = proc.run(
        ["bash", "-c", 'echo "$ONLY_VAR $(pwd)"; cat'], timeout=10, env={"ONLY_VAR": "set", "PATH": os.environ["PATH"]},
        cwd=tmp_path, input="from stdin\n",
    )
    assert done.stdout == f"set {tmp_path}\nfrom stdin\n"


def test_stdin_is_not_the_terminal():
    # without input, a program reading stdin gets EOF at once instead of waiting
    assert proc.run(["cat"], timeout=10).stdout == ""


def test_undecodable_output_is_replaced_not_fatal():
    done = proc.run(["printf", r"\xff\xfeok"], timeout=10)
    assert done.stdout.endswith("ok")


def test_timeout_kills_the_command_and_its_children(tmp_path):
    marker = tmp_path / "child.pid"
    start = time.monotonic()
    with pytest.raises(proc.CommandTimeoutError) as info:
        proc.run(["bash", "-c", f"sleep 30 & echo $! > {marker}; echo started; wait"], timeout=1)
    assert time.monotonic() - start < 10
    err = info.value
    assert str(err).startswith("bash timed out after 1 s and was killed")
    assert err.timeout == 1 and err.returncode is None and err.stdout == "started\n"
    assert isinstance(err, CommandError)
    child = int(marker.read_text())
    time.sleep(0.2)
    assert not _running(child), "the command's child outlived the timeout"


def test_missing_executable_is_one_clear_line():
    with pytest.raises(proc.CommandNotFoundError) as info:
        proc.run(["no-such-program-hpcmem", "--help"], timeout=10)
    assert str(info.value) == "command not found: no-such-program-hpcmem"
    assert isinstance(info.value, HpcmemError) and info.value.returncode == 127


def test_missing_working_directory_is_named(tmp_path):
    with pytest.raises(CommandError, match="working directory .*nowhere does not exist"):
        proc.run(["true"], timeout=10, cwd=tmp_path / "nowhere")


def test_not_executable(tmp_path):
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    with pytest.raises(CommandError, match="permission denied"):
        proc.run([script], timeout=10)


@pytest.mark.parametrize("argv, error", [("echo hi", TypeError), ([], ValueError), (["echo", 3], TypeError)])
def test_argv_must_be_a_list_of_strings(argv, error):
    with pytest.raises(error):
        proc.run(argv, timeout=10)


# ---------------------------------------------------------------- spawn_detached


def test_spawn_detached_runs_in_its_own_session(tmp_path):
    log = tmp_path / "out.log"
    log.write_text("earlier line\n")
    pid = proc.spawn_detached(
        ["bash", "-c", "echo out; echo err >&2; pwd; echo $SPAWN_VAR; ulimit -v"],
        env={"SPAWN_VAR": "v", "PATH": os.environ["PATH"]}, cwd=tmp_path, stdout_path=log,
    )
    assert os.getsid(pid) == pid and os.getpgid(pid) == pid
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert log.read_text() == f"earlier line\nout\nerr\n{tmp_path}\nv\nunlimited\n"


def test_spawn_detached_address_space_limit(tmp_path):
    log = tmp_path / "out.log"
    pid = proc.spawn_detached(["bash", "-c", "ulimit -v; ulimit -H -v"], env=None, cwd=tmp_path, stdout_path=log,
                              address_space_mib=1500)
    os.waitpid(pid, 0)
    assert log.read_text().split() == [str(1500 * 1024)] * 2


def test_spawn_detached_outlives_a_timeout_of_its_caller(tmp_path):
    """A detached child is not in the caller's process group: killing the caller's group leaves it."""
    log = tmp_path / "out.log"
    pid = proc.spawn_detached(["sleep", "30"], env=None, cwd=tmp_path, stdout_path=log)
    try:
        assert os.getpgid(pid) != os.getpgid(0)
        assert _running(pid)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_spawn_detached_missing_executable(tmp_path):
    with pytest.raises(proc.CommandNotFoundError, match="command not found: no-such-program-hpcmem"):
        proc.spawn_detached(["no-such-program-hpcmem"], env=None, cwd=tmp_path, stdout_path=tmp_path / "log")


def test_reap_detached_leaves_no_zombies(tmp_path):
    pid = proc.spawn_detached(["true"], env=None, cwd=tmp_path, stdout_path=tmp_path / "log")
    deadline = time.monotonic() + 10
    while _state(pid) not in ("Z", None) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.reap_detached()
    assert _state(pid) is None


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _running(pid):
    return _state(pid) not in (None, "Z", "X")
