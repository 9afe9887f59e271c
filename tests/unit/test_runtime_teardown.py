"""toolkit/runtime/run_script.py, the way a job starts a user's script: it runs as `python SCRIPT` would (exit codes,
tracebacks, sys.argv, __name__, __file__, sys.path), and a script that ended normally has its torch.distributed
process group destroyed at exit (real gloo groups, real torchrun), bounded by a timeout.

The crash it prevents, reproduced here with the plain interpreter: a gloo collective still in flight when the
interpreter finalizes aborts the process (`terminate called without an active exception`, SIGABRT, exit -6) in
2 of 8 torchrun runs of the script in test_in_flight_gloo_work_at_exit_never_aborts, 5 of 8 when a library keeps a
group alive (as DeepSpeed does); 0 of 18 through the runner (docs/triage.md, "teardown")."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from toolkit import jobspec
from toolkit.runtime import run_script

RUNNER = Path(run_script.__file__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tmp_path, body: str, *args, env=None, timeout=120, launcher=()):
    script = tmp_path / "sub dir" / "user_script.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(textwrap.dedent(body))
    full = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **(env or {})}
    full.pop("PYTHONPATH", None)  # the runner must not need hpcmem importable
    return script, subprocess.run([sys.executable, *launcher, str(RUNNER), str(script), *map(str, args)],
                                  capture_output=True, text=True, timeout=timeout, env=full, cwd=tmp_path)


def test_the_script_sees_what_python_script_would_show_it(tmp_path):
    out = tmp_path / "seen.json"
    script, done = run(tmp_path, """\
        import json, sys
        def helper():
            return 1
        json.dump({"name": __name__, "file": __file__, "argv": sys.argv, "path0": sys.path[0],
                   "torch": "torch" in sys.modules, "main_has_helper": hasattr(sys.modules["__main__"], "helper")},
                  open(sys.argv[-1], "w"))
        """, "--flag", "a b", "ü", out)
    assert done.returncode == 0, done.stderr
    seen = json.loads(out.read_text())
    assert seen["name"] == "__main__" and seen["file"] == str(script)
    assert seen["argv"] == [str(script), "--flag", "a b", "ü", str(out)]
    assert seen["path0"] == str(script.parent)  # the script's directory, not the runner's
    assert seen["main_has_helper"] and not seen["torch"]  # no torch imported by the runner itself


@pytest.mark.parametrize("body, code", [("import sys; sys.exit(3)", 3), ("raise SystemExit('bad input')", 1),
                                        ("pass", 0), ("import sys; sys.exit(0)", 0), ("import os; os._exit(7)", 7)])
def test_exit_statuses_are_the_script_s(tmp_path, body, code):
    _, done = run(tmp_path, body)
    assert done.returncode == code, done.stderr
    if "bad input" in body:
        assert done.stderr.strip().endswith("bad input")


def test_an_exception_prints_its_traceback_and_exits_1(tmp_path):
    _, done = run(tmp_path, """\
        def train():
            raise ValueError("boom at step 3")
        if __name__ == "__main__":
            train()
        """)
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr
    assert 'user_script.py", line 2, in train' in done.stderr and done.stderr.rstrip().endswith(
        "ValueError: boom at step 3")
    assert "hpcmem" not in done.stderr  # nothing added to a failure


def test_a_missing_script_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, str(RUNNER), str(tmp_path / "nope.py")], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip() == f"hpcmem: {tmp_path / 'nope.py'}: no such script"


SPY = """\
    import json, os, sys
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", rank=0, world_size=1)
    dist.all_reduce(torch.ones(3))

    def native_threads():
        return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))

    before = native_threads()
    real_destroy = dist.destroy_process_group

    def spy(*args, **kwargs):  # records what the runner's teardown did, then does it
        real_destroy(*args, **kwargs)
        json.dump({"before": before, "after": native_threads(), "initialized": dist.is_initialized()},
                  open(sys.argv[1], "w"))

    dist.destroy_process_group = spy
    """


def test_an_initialised_gloo_group_is_destroyed_at_a_normal_exit(tmp_path):
    out = tmp_path / "teardown.json"
    _, done = run(tmp_path, SPY, out)
    assert done.returncode == 0, done.stderr
    seen = json.loads(out.read_text())
    assert "pt_gloo_runloop" in seen["before"]  # gloo's worker threads, alive when the script ended
    assert not any(t.startswith(("pt_gloo", "gloo_")) for t in seen["after"]) and not seen["initialized"]


def test_after_a_failure_the_group_is_left_as_it_was(tmp_path):
    out = tmp_path / "teardown.json"
    _, done = run(tmp_path, SPY + "sys.exit(4)\n", out)
    assert done.returncode == 4 and not out.exists()


IN_FLIGHT = """\
    import torch, torch.distributed as dist
    import holder_lib
    dist.init_process_group("gloo")
    if holder_lib.HOLD:  # a library keeps a group to the end, as DeepSpeed keeps its groups
        holder_lib.GROUP = dist.new_group(list(range(dist.get_world_size())))
    for _ in range(8):  # fire and forget: the work holds the last reference to its tensor at exit
        dist.all_reduce(torch.ones(4_000_000), async_op=True)
    print("done", dist.get_rank(), flush=True)
    """


@pytest.mark.slow
@pytest.mark.parametrize("hold", [False, True], ids=["own-groups", "group-held-by-a-library"])
def test_in_flight_gloo_work_at_exit_never_aborts(tmp_path, hold):
    """Two ranks under torchrun, 5 times: each ends 0. Measured without the runner (torchrun on the plain script):
    2 of 8 runs aborted with -6 with its own groups, 5 of 8 with a group held by a library; through it 0 of 18."""
    (tmp_path / "sub dir").mkdir()
    (tmp_path / "sub dir" / "holder_lib.py").write_text(f"HOLD = {hold}\nGROUP = None\n")
    launcher = ("-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2")
    for i in range(5):
        _, done = run(tmp_path, IN_FLIGHT, launcher=launcher, timeout=180)
        assert done.returncode == 0, f"run {i + 1}: {done.stderr[-3000:]}"
        assert "terminate called" not in done.stderr and done.stdout.count("done") == 2
        assert ("skipping interpreter finalization" in done.stderr) == hold


def test_a_group_a_library_keeps_ends_without_finalization_and_open_files_are_flushed(tmp_path):
    """A library holds the group (its gloo threads outlive destroy_process_group) and has written to a file it
    never flushed: the process skips finalization with status 0, and the file still gets its text."""
    (tmp_path / "sub dir").mkdir()
    (tmp_path / "sub dir" / "holder_lib.py").write_text("GROUP = None\nLOG = None\n")
    out = tmp_path / "lib.log"
    _, done = run(tmp_path, """\
        import sys, torch, torch.distributed as dist
        import holder_lib
        dist.init_process_group("gloo", rank=0, world_size=1)
        holder_lib.GROUP = dist.group.WORLD
        holder_lib.LOG = open(sys.argv[1], "w", buffering=1 << 20)
        holder_lib.LOG.write("last words")
        """, out)
    assert done.returncode == 0, done.stderr
    assert "communication thread(s) are still held by the training libraries (gloo_tcp_loop, pt_gloo_runloop" \
        in done.stderr and "skipping interpreter finalization" in done.stderr
    assert out.read_text() == "last words"


def test_comm_threads_reads_thread_names(tmp_path):
    for tid, name in (("1", "python3"), ("2", "pt_gloo_runloop"), ("3", "pt_nccl_watchdg"), ("4", "loader")):
        (tmp_path / tid).mkdir()
        (tmp_path / tid / "comm").write_text(name + "\n")
    assert sorted(run_script.comm_threads(str(tmp_path))) == ["pt_gloo_runloop", "pt_nccl_watchdg"]
    assert run_script.comm_threads(str(tmp_path / "missing")) is None


def test_a_hung_teardown_is_bounded_and_keeps_status_0(tmp_path):
    """Rank 1 lingers after its work, so rank 0's barrier waits: after HPCMEM_TEARDOWN_TIMEOUT_S rank 0 exits 0
    with one line saying so, without finalizing; rank 1 then finds its peer gone and still ends 0."""
    launcher = ("-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2")
    _, done = run(tmp_path, """\
        import time, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        dist.all_reduce(torch.ones(3))
        if dist.get_rank() == 1:
            time.sleep(15)
        """, env={"HPCMEM_TEARDOWN_TIMEOUT_S": "2"}, launcher=launcher, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hpcmem: torch.distributed teardown timed out after 2 s (bound 2 s)" in done.stderr


@pytest.mark.parametrize("text, value", [("", 120.0), ("5", 5.0), ("0.5", 0.5), ("0", 120.0), ("-1", 120.0),
                                         ("abc", 120.0), ("inf", 120.0), ("nan", 120.0)])
def test_the_timeout_comes_from_the_environment(text, value, capsys):
    assert run_script.timeout_s({"HPCMEM_TEARDOWN_TIMEOUT_S": text}) == value
    assert ("not a positive number" in capsys.readouterr().err) == (text not in ("", "5", "0.5"))


def test_jobs_start_user_scripts_through_the_runner_and_modules_as_they_are(tmp_path):
    spec_path = tmp_path / "s.yaml"
    (tmp_path / "train.py").write_text("")
    spec_path.write_text("name: s\ncommand: {script: train.py, args: [--x, '{attempt_dir}']}\n"
                         "training: {global_batch: 1}\n")
    spec = jobspec.load_spec(spec_path)
    from toolkit import sites

    plan = spec.first_plan(sites.load_site("testcluster").partition("cpu"))
    assert spec.argv(plan, {"attempt_dir": "/a"}) == [str(RUNNER.resolve()), str(tmp_path / "train.py"), "--x", "/a"]
    assert jobspec.SCRIPT_RUNNER.is_file()
    module = jobspec.load_spec("quickstart")
    assert module.argv(module.first_plan(sites.load_site("testcluster").partition("cpu")),
                       {"attempt_dir": "/a", "plan_json": "/p"})[:2] == ["-m", "toolkit.train"]
