"""The local backend (``--site local``): the same job script, run on this machine without Slurm.

Contracts:

- **Job ids** are ``local-<n>``, ``n`` from a counter under the backend's state
  directory (``$HPCMEM_HOME/local``, default ``~/.hpcmem/local``), unique for that
  home. ``jobs/<id>.json`` there maps an id to its attempt directory and runner, so
  a later process (``hpcmem tick``) can poll and cancel it.
- **The script's directives are the job's resources**, as under Slurm: the memory cap
  is the script's ``#SBATCH --mem`` (``default_mem_mib`` when it has none; ``--mem=0``
  means no cap) and becomes RLIMIT_AS of the job's processes. RLIMIT_AS is per
  process, so each rank gets the whole cap (Slurm's cgroup caps their sum). A script
  that asks for GPUs gets no address-space cap: CUDA reserves far more virtual
  memory than it uses and would not start; there the runtime caps the CUDA memory
  fraction instead. ``--time`` is enforced (TIMEOUT); ``--output`` is not read: the
  log is always ``<attempt_dir>/slurm-<id>.out``, the name the templates give Slurm.
- **Environment**: the caller's, without a calling Slurm job's variables, plus what a
  one-node Slurm job sees (SLURM_JOB_ID, SLURM_JOB_NAME, SLURM_NNODES=1, SLURM_NODEID=0,
  SLURM_PROCID=0, SLURM_JOB_NODELIST=localhost, SLURM_SUBMIT_DIR, SLURM_CPUS_ON_NODE,
  SLURM_GPUS_ON_NODE and SLURM_MEM_PER_NODE when known) and MALLOC_ARENA_MAX=2 (fewer
  malloc arenas keep a process's address space close to what it really uses).
- **Files** in the attempt directory: ``slurm-<id>.out`` (the log), ``<id>.json`` (the
  runner's result, written atomically), ``<id>.pid`` (the job's process group) and
  ``<id>.cancel`` (a cancel request).
- **States**: PENDING from the job's record until its runner has started (there is no
  queue: a moment), RUNNING while the runner lives and has not written its result; then the
  runner's COMPLETED / FAILED / TIMEOUT / CANCELLED. A runner that vanished after starting the
  job is FAILED with a reason (and whatever the job left running is killed, as when
  slurmstepd dies); one that vanished before starting it is BOOT_FAIL.
- **Crash safety of submit**: the record (``runner_pid: null``, the submitting process's pid)
  is written before the runner is spawned, and the runner *claims* the job
  (``jobs/<id>.claim``, created with ``link``, so exactly one claim exists) before it starts
  the script. A job whose record has no runner is PENDING while its submitter lives (at most
  ``start_grace_s()``); after that whoever looks first claims it as abandoned: it never runs,
  its result is BOOT_FAIL ("never started"), and ``find`` skips it, so the controller submits
  the attempt again. A runner that lost the claim exits without running anything; a runner
  that won it is found through the claim even when the submitter died before recording its pid.
- **Accounting** (``job_facts``, ``failed_jobs``, ``batch_scripts``, ``controller_facts``):
  answered from the job records and results under the state directory, in the shape of
  ``slurm.parse_sacct_facts``.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import getpass
import json
import os
import signal
import sys
import time
from pathlib import Path

import toolkit

from .. import proc
from ..files import write_atomic
from ..errors import CommandError, SchedulerError
from ..resources import env_number
from .base import (
    BOOT_FAIL, CANCELLED, COMPLETED, FAILED, PENDING, RUNNING, UNKNOWN, Backend, JobStatus, fault,
)
from .slurm import clean_environment, gpus_requested, parse_mem_mib, parse_time_limit_s, read_directives

# The runner is started as ``python -m toolkit.backends.local_runner`` from the directory
# holding the package, so it imports this very hpcmem (checkout or installed).
_PACKAGE_PARENT = Path(toolkit.__file__).resolve().parent.parent


def result_path(attempt_dir: Path, job_id: str) -> Path:
    """The runner's record of how the job ended."""
    return Path(attempt_dir) / f"{job_id}.json"


def pid_path(attempt_dir: Path, job_id: str) -> Path:
    """The job's pid (= its process group), written once the script has started."""
    return Path(attempt_dir) / f"{job_id}.pid"


def cancel_path(attempt_dir: Path, job_id: str) -> Path:
    """Present when the job was asked to stop; survives a lost signal."""
    return Path(attempt_dir) / f"{job_id}.cancel"



def start_grace_s() -> float:
    """How long a job whose runner is not recorded yet stays PENDING while its submitter lives
    (``$HPCMEM_LOCAL_START_GRACE_S``, 60 s by default)."""
    return env_number("HPCMEM_LOCAL_START_GRACE_S", 60.0)

_SCRIPT_MAX_BYTES = 1 << 20


def claim_path(state_dir: Path, job_id: str) -> Path:
    """Who runs the job: its runner (``{"by": "runner", "pid", "start"}``) or nobody (``{"by": "abandoned"}``)."""
    return Path(state_dir) / "jobs" / f"{job_id}.claim"


def take_claim(path: Path, claim: dict) -> dict:
    """Create ``path`` holding ``claim`` unless it exists; return the claim that is there now (ours or the
    earlier one). ``link`` makes it atomic: of two claimants exactly one wins, and nobody reads half a claim."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    tmp.write_text(json.dumps(claim) + "\n")
    try:
        os.link(tmp, path)
        return claim
    except FileExistsError:
        return read_claim(path) or claim
    finally:
        tmp.unlink(missing_ok=True)


def read_claim(path: Path) -> dict | None:
    try:
        claim = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return claim if isinstance(claim, dict) else None


def now_iso(epoch: float | None = None) -> str:
    return dt.datetime.fromtimestamp(time.time() if epoch is None else epoch).astimezone().isoformat(timespec="seconds")


def default_state_dir() -> Path:
    """``$HPCMEM_HOME/local`` (HPCMEM_HOME defaults to ``~/.hpcmem``)."""
    return Path(os.environ.get("HPCMEM_HOME") or "~/.hpcmem").expanduser() / "local"


class LocalBackend(Backend):
    """Runs job scripts on this machine under a memory cap and a time limit."""

    name = "local"

    def __init__(
        self,
        *,
        state_dir: Path | None = None,
        default_mem_mib: int | None = None,
        kill_wait_s: float = 5.0,
    ):
        """``state_dir``: where ids and job records live (default ``default_state_dir()``);
        ``default_mem_mib``: cap for scripts without ``--mem`` (None: no cap);
        ``kill_wait_s``: grace between SIGTERM and SIGKILL on cancel and time limit."""
        self.state_dir = Path(state_dir) if state_dir else default_state_dir()
        self.default_mem_mib = default_mem_mib
        self.kill_wait_s = kill_wait_s

    # -- submit

    def submit(self, script: Path, attempt_dir: Path) -> str:
        """Start ``bash script`` detached under the runner; return ``local-<n>`` at once."""
        script, attempt_dir = Path(script).resolve(), Path(attempt_dir).resolve()
        if not script.is_file():
            raise SchedulerError(f"job script not found: {script}")
        if not attempt_dir.is_dir():
            raise SchedulerError(f"attempt directory not found: {attempt_dir}")
        directives = read_directives(script.read_text(errors="replace"))
        gpus = gpus_requested(directives)
        mem_mib = self.mem_cap_mib(directives)
        time_limit_s = _time_limit_s(directives)
        cwd = Path(attempt_dir, directives.get("chdir") or ".").resolve()

        job_id = self._next_id()
        fault("local_after_id")
        log = self.log_path(attempt_dir, job_id)
        me = os.getpid()
        record = {
            "job_id": job_id, "attempt_dir": str(attempt_dir), "script": str(script), "log": str(log),
            "submitted": time.time(), "mem_cap_mib": mem_mib, "time_limit_s": time_limit_s,
            "name": directives.get("job-name") or script.name, "partition": directives.get("partition"),
            "cwd": str(cwd), "user": _user(), "gpus": gpus,
            "submitter_pid": me, "submitter_start": _start_ticks(me),
            "runner_pid": None, "runner_start": None,
        }
        self._write_record(record)
        fault("local_after_record")
        env = job_environment(
            os.environ, job_id=job_id, job_name=record["name"],
            submit_dir=attempt_dir, gpus=gpus, mem_mib=mem_mib, partition=directives.get("partition"),
        )
        argv = [
            sys.executable, "-m", "toolkit.backends.local_runner", "--job-id", job_id, "--script", str(script),
            "--attempt-dir", str(attempt_dir), "--cwd", str(cwd), "--log", str(log),
            "--kill-wait-s", str(self.kill_wait_s), "--claim", str(claim_path(self.state_dir, job_id)),
        ]
        if mem_mib is not None and not gpus:
            argv += ["--mem-mib", str(mem_mib)]
        if time_limit_s is not None:
            argv += ["--time-limit-s", str(time_limit_s)]
        try:
            pid = proc.spawn_detached(argv, env=env, cwd=_PACKAGE_PARENT, stdout_path=log)
        except (CommandError, OSError) as exc:
            self._abandon(record, f"its runner could not be started: {exc}")
            raise SchedulerError(f"local: could not start the runner of {job_id}: {exc}") from exc
        fault("local_after_spawn")
        self._write_record({**record, "runner_pid": pid, "runner_start": _start_ticks(pid)})
        return job_id

    def mem_cap_mib(self, directives: dict[str, str]) -> int | None:
        """The job's memory cap in MiB: ``--mem`` (plain numbers are MB, as for sbatch), else the default."""
        if "mem" not in directives:
            return self.default_mem_mib
        mib = parse_mem_mib(directives["mem"], default_unit="M")
        if mib is None:
            raise SchedulerError(f"cannot read #SBATCH --mem={directives['mem']}")
        return int(mib) or None  # --mem=0: all of the node's memory

    def test_only(self, script: Path) -> str:
        """``bash -n`` the script and read its directives; return what a submit would do."""
        script = Path(script).resolve()
        done = proc.run(["bash", "-n", str(script)], timeout=30, check=False)
        if done.returncode != 0:
            raise SchedulerError(f"bash -n {script}: {(done.stderr.strip().splitlines() or ['syntax error'])[0]}")
        directives = read_directives(script.read_text(errors="replace"))
        mem = self.mem_cap_mib(directives)
        limit = _time_limit_s(directives)
        return (
            f"local: job would run on localhost with "
            f"{'no memory cap' if mem is None or gpus_requested(directives) else f'a {mem} MiB address-space cap'} "
            f"and {'no time limit' if limit is None else f'a {limit:g} s time limit'}"
        )

    # -- poll

    def poll(self, job_ids: list[str]) -> dict[str, JobStatus]:
        proc.reap_detached()  # leave no zombie runners in a long-lived caller
        return {job_id: self._status(job_id) for job_id in dict.fromkeys(job_ids)}

    def _status(self, job_id: str) -> JobStatus:
        record = self._read_record(job_id)
        if record is None:
            return JobStatus(job_id, UNKNOWN, reason=f"no local job {job_id} under {self.state_dir}")
        attempt_dir = Path(record["attempt_dir"])
        done = _read_result(attempt_dir, job_id)
        if done:
            return done
        if record.get("runner_pid") is None:
            record = self._settle_start(record)
            if record.get("runner_pid") is None:
                return _read_result(attempt_dir, job_id) or JobStatus(job_id, PENDING, node="localhost",
                                                                      reason="starting")
        if _alive(record["runner_pid"], record.get("runner_start")):
            return JobStatus(job_id, RUNNING, elapsed_s=time.time() - record["submitted"], node="localhost")
        done = _read_result(attempt_dir, job_id)  # it may have finished between the two looks
        if done:
            return done
        return self._runner_vanished(record)

    def _settle_start(self, record: dict) -> dict:
        """A record without a runner pid: the runner that claimed the job (its pid recorded now), or, once
        nobody can start it any more, the job abandoned (BOOT_FAIL). Returns the record as it stands."""
        job_id = record["job_id"]
        claim = read_claim(claim_path(self.state_dir, job_id))
        if claim is None:
            if self._submitter_may_still_start(record):
                return record
            claim = self._abandon(record, "the job never started: the process submitting it "
                                          f"(pid {record.get('submitter_pid')}) died before starting its runner")
        if claim.get("by") == "runner" and isinstance(claim.get("pid"), int):
            record = {**record, "runner_pid": claim["pid"], "runner_start": claim.get("start")}
            self._write_record(record)
        return record

    def _submitter_may_still_start(self, record: dict) -> bool:
        if time.time() - record["submitted"] > start_grace_s():
            return False
        pid = record.get("submitter_pid")
        return isinstance(pid, int) and _alive(pid, record.get("submitter_start"))

    def _abandon(self, record: dict, reason: str, state: str = BOOT_FAIL) -> dict:
        """Claim a job nobody started as never to run, and record it BOOT_FAIL; returns the claim that won
        (the runner's, when it was quicker: then the job runs and nothing is recorded here)."""
        job_id = record["job_id"]
        path = claim_path(self.state_dir, job_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        claim = take_claim(path, {"by": "abandoned", "at": time.time(), "reason": reason})
        if claim.get("by") == "abandoned":
            _record_once(Path(record["attempt_dir"]), job_id, {
                "job_id": job_id, "state": state, "exit_code": None, "signal": None, "start": None, "end": now_iso(),
                "elapsed_s": 0.0, "max_rss_mib": None, "reason": claim.get("reason", reason), "node": "localhost",
            })
        return claim

    def _runner_vanished(self, record: dict) -> JobStatus:
        """The runner is gone without a result: BOOT_FAIL if it never started the job, else FAILED (and the
        job's process group, nobody's now, is killed). Recorded, so every later look says the same."""
        attempt_dir, job_id = Path(record["attempt_dir"]), record["job_id"]
        if cancel_path(attempt_dir, job_id).exists():
            state, reason = CANCELLED, "cancelled; the runner ended before recording it"
        else:
            state = FAILED
            reason = f"the local runner (pid {record['runner_pid']}) ended without recording a result"
        job_pid = _job_pid(attempt_dir, job_id)
        if job_pid:
            if _kill_group(job_pid):
                reason += "; its job was killed with it"
        elif state == FAILED:
            take_claim(claim_path(self.state_dir, job_id), {"by": "abandoned", "at": time.time(), "reason": reason})
            state, reason = BOOT_FAIL, f"the local runner (pid {record['runner_pid']}) died before starting the job"
        _record_once(attempt_dir, job_id, {
            "job_id": job_id, "state": state, "exit_code": None, "signal": None, "start": None, "end": now_iso(),
            "elapsed_s": round(time.time() - record["submitted"], 3), "max_rss_mib": None, "reason": reason,
            "node": "localhost",
        })
        return _read_result(attempt_dir, job_id) or JobStatus(job_id, state, node="localhost", reason=reason)

    # -- cancel

    def cancel(self, job_ids: list[str]) -> None:
        """Ask each runner to stop its job (SIGTERM, SIGKILL after ``kill_wait_s``) and wait
        until CANCELLED is recorded; a runner that does not answer is killed with its job."""
        waiting = []
        for job_id in dict.fromkeys(job_ids):
            record = self._read_record(job_id)
            if record is None or result_path(Path(record["attempt_dir"]), job_id).exists():
                continue
            write_atomic(cancel_path(Path(record["attempt_dir"]), job_id), f"{time.time()}\n")
            if record.get("runner_pid") is None:
                record = self._settle_start(record)
                if record.get("runner_pid") is None:  # nobody started it: make sure nobody will
                    self._abandon(record, "cancelled before it started", CANCELLED)
                    continue
            if record["runner_pid"] and _alive(record["runner_pid"], record["runner_start"]):
                _kill(record["runner_pid"], signal.SIGTERM)
            waiting.append(record)
        deadline = time.time() + self.kill_wait_s + 5.0
        while waiting and time.time() < deadline:
            proc.reap_detached()
            waiting = [r for r in waiting if not _settled(r)]
            time.sleep(0.1)
        for record in waiting:
            self._force_cancel(record)

    def _force_cancel(self, record: dict) -> None:
        """The runner did not record the cancel in time: kill it and its job, record it here."""
        attempt_dir, job_id = Path(record["attempt_dir"]), record["job_id"]
        if record["runner_pid"] and _alive(record["runner_pid"], record["runner_start"]):
            _kill(record["runner_pid"], signal.SIGKILL)
        job_pid = _job_pid(attempt_dir, job_id)
        if job_pid:
            _kill_group(job_pid)
        result = {
            "job_id": job_id, "state": CANCELLED, "exit_code": None, "signal": signal.SIGKILL.value,
            "start": None, "end": None, "elapsed_s": time.time() - record["submitted"], "max_rss_mib": None,
            "reason": "cancelled; the runner did not answer and was killed", "node": "localhost",
        }
        _record_once(attempt_dir, job_id, result)

    # -- find

    def find(self, job_name: str, attempt_dir: Path) -> str | None:
        """The newest local job started for ``attempt_dir`` (the name is not needed: the records hold the
        directory). A job that was abandoned before it started does not count: it never ran."""
        attempt_dir = str(Path(attempt_dir).resolve())
        found = []
        for record in self._records():
            if record.get("attempt_dir") == attempt_dir:
                found.append(record["job_id"])
        for job_id in sorted(found, key=_id_number, reverse=True):
            claim = read_claim(claim_path(self.state_dir, job_id))
            if claim is None and self._read_record(job_id).get("runner_pid") is None:
                self._status(job_id)  # settles it: started, still starting, or abandoned
                claim = read_claim(claim_path(self.state_dir, job_id))
            if claim is None or claim.get("by") != "abandoned":
                return job_id
        return None

    # -- accounting (triage)

    def job_facts(self, job_ids: list[str]) -> dict[str, dict]:
        """The local jobs' records and results as ``slurm.parse_sacct_facts`` shapes them; unknown ids are absent."""
        out = {}
        for job_id in dict.fromkeys(job_ids):
            record = self._read_record(job_id)
            if record is not None:
                out[job_id] = self._facts(record, self._status(job_id))
        return out

    def failed_jobs(self, start_s: float, end_s: float, *, partition: str | None = None,
                    user: str | None = None) -> dict[str, dict]:
        """Every local job that ended badly between ``start_s`` and ``end_s`` (by the end its result records)."""
        out = {}
        for record in self._records():
            done = _read_result(Path(record["attempt_dir"]), record["job_id"])
            if done is None or done.state == COMPLETED:
                continue
            ended = _result_end(done.raw)
            if ended is None or not start_s <= ended <= end_s:
                continue
            if (partition and record.get("partition") != partition) or (user and record.get("user") != user):
                continue
            out[record["job_id"]] = self._facts(record, done)
        return out

    def batch_scripts(self, job_ids: list[str]) -> dict[str, str]:
        """The job scripts the records point at, while they still exist (the attempt directory keeps them)."""
        out = {}
        for job_id in dict.fromkeys(job_ids):
            record = self._read_record(job_id)
            if record is None:
                continue
            try:
                with open(record["script"], "rb") as handle:
                    out[job_id] = handle.read(_SCRIPT_MAX_BYTES).decode(errors="replace")
            except OSError:
                continue
        return out

    def controller_facts(self, job_ids: list[str]) -> dict[str, dict]:
        """As ``job_facts`` plus the log (``stdout``/``stderr``) and the script (``command``); no steps."""
        out = {}
        for job_id, facts in self.job_facts(job_ids).items():
            record = self._read_record(job_id)
            out[job_id] = {**facts, "max_rss_mib": None, "steps": [], "stdout": record["log"],
                           "stderr": record["log"], "command": record["script"]}
        return out

    def _facts(self, record: dict, status: JobStatus) -> dict:
        mem = record.get("mem_cap_mib")
        tres = {"cpu": str(len(os.sched_getaffinity(0))), "node": "1"}
        if mem:
            tres["mem"] = f"{mem}M"
        if record.get("gpus"):
            tres["gres/gpu"] = str(record["gpus"])
        result = {}
        try:
            result = json.loads(status.raw) if status.raw else {}
        except ValueError:
            pass
        return {
            "array_job_id": None, "array_task_id": None, "job_id": record["job_id"], "raw_id": record["job_id"],
            "name": record.get("name"), "user": record.get("user"), "partition": record.get("partition"),
            "cluster": "local", "state": status.state, "state_text": status.state, "exit_code": status.exit_code,
            "signal": status.signal, "elapsed_s": status.elapsed_s, "timelimit_s": record.get("time_limit_s"),
            "max_rss_mib": status.max_rss_mib, "req_tres": dict(tres), "alloc_tres": dict(tres),
            "nodes": "localhost", "workdir": record.get("cwd"), "submit": now_iso(record["submitted"]),
            "start": result.get("start"), "end": result.get("end"), "reason": status.reason, "steps": [],
        }

    # -- the state directory

    def _next_id(self) -> str:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        counter = self.state_dir / "last_id"
        with open(self.state_dir / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                try:
                    last = int(counter.read_text()) if counter.exists() else 0
                except ValueError:  # a damaged counter: never reuse an id that has a record
                    last = max((_id_number(r["job_id"]) for r in self._records()), default=0)
                write_atomic(counter, f"{last + 1}\n")
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return f"local-{last + 1}"

    def _record_path(self, job_id: str) -> Path:
        if not job_id.startswith("local-") or not job_id[len("local-"):].isdigit():
            raise SchedulerError(f"not a local job id: {job_id!r}")
        return self.state_dir / "jobs" / f"{job_id}.json"

    def _write_record(self, record: dict) -> None:
        path = self._record_path(record["job_id"])
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(record, indent=2) + "\n")

    def _read_record(self, job_id: str) -> dict | None:
        path = self._record_path(job_id)
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise SchedulerError(f"local job record {path} is unreadable ({exc}); see `hpcmem doctor`") from None
        if not isinstance(record, dict) or not {"job_id", "attempt_dir", "submitted"} <= set(record):
            raise SchedulerError(f"local job record {path} is damaged; see `hpcmem doctor`")
        return record

    def _records(self) -> list[dict]:
        """Every readable job record (damaged ones are skipped: ``hpcmem doctor`` reports them)."""
        out = []
        for path in (self.state_dir / "jobs").glob("local-*.json"):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(record, dict) and {"job_id", "attempt_dir", "submitted"} <= set(record):
                out.append(record)
        return out


def job_environment(
    base, *, job_id: str, job_name: str, submit_dir: Path, gpus: int, mem_mib: int | None, partition: str | None,
) -> dict[str, str]:
    """The environment of a local job: ``base`` cleaned of a calling Slurm job, plus a one-node Slurm job's."""
    env = clean_environment(base)
    env.update(
        SLURM_JOB_ID=job_id, SLURM_JOBID=job_id, SLURM_JOB_NAME=job_name,
        SLURM_NNODES="1", SLURM_JOB_NUM_NODES="1", SLURM_NODEID="0", SLURM_PROCID="0", SLURM_LOCALID="0",
        SLURM_JOB_NODELIST="localhost", SLURM_NODELIST="localhost", SLURMD_NODENAME="localhost",
        SLURM_SUBMIT_DIR=str(submit_dir), SLURM_SUBMIT_HOST="localhost",
        SLURM_CPUS_ON_NODE=str(len(os.sched_getaffinity(0))),
    )
    if gpus:
        env["SLURM_GPUS_ON_NODE"] = str(gpus)
    if mem_mib:
        env["SLURM_MEM_PER_NODE"] = str(mem_mib)
    if partition:
        env["SLURM_JOB_PARTITION"] = partition
    env.setdefault("MALLOC_ARENA_MAX", "2")
    return env


def _time_limit_s(directives: dict[str, str]) -> float | None:
    if "time" not in directives:
        return None
    try:
        return parse_time_limit_s(directives["time"])
    except ValueError:
        raise SchedulerError(f"cannot read #SBATCH --time={directives['time']}") from None


def _read_result(attempt_dir: Path, job_id: str) -> JobStatus | None:
    try:
        text = result_path(attempt_dir, job_id).read_text()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        return JobStatus(
            job_id=job_id, state=data["state"], exit_code=data.get("exit_code"), signal=data.get("signal"),
            elapsed_s=data.get("elapsed_s"), max_rss_mib=data.get("max_rss_mib"), node=data.get("node"),
            reason=data.get("reason"), raw=text,
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        return JobStatus(job_id, FAILED, node="localhost", raw=text,
                         reason=f"the job's result {result_path(attempt_dir, job_id)} is unreadable")


def _record_once(attempt_dir: Path, job_id: str, result: dict) -> None:
    """Write a result the runner did not write (never over one it did: ``link`` fails if it exists)."""
    tmp = Path(attempt_dir) / f".{job_id}.{os.getpid()}.result.tmp"
    try:
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        os.link(tmp, result_path(attempt_dir, job_id))
    except FileExistsError:
        pass
    except OSError:  # the attempt directory is gone: nothing to record into
        pass
    finally:
        tmp.unlink(missing_ok=True)


def _result_end(raw: str) -> float | None:
    try:
        end = json.loads(raw).get("end")
        return dt.datetime.fromisoformat(end).timestamp() if end else None
    except (ValueError, TypeError, AttributeError):
        return None


def _id_number(job_id: str) -> int:
    try:
        return int(job_id.split("-", 1)[1])
    except (IndexError, ValueError):
        return 0


def _user() -> str | None:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return None


def _settled(record: dict) -> bool:
    """The runner has recorded the result, or is gone."""
    attempt_dir = Path(record["attempt_dir"])
    if result_path(attempt_dir, record["job_id"]).exists():
        return True
    return bool(record["runner_pid"]) and not _alive(record["runner_pid"], record["runner_start"])


def _start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), to tell it from a later process with the same pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _alive(pid: int, start_ticks: int | None) -> bool:
    """``pid`` is running (not a zombie) and is still the process we started."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: fall back to signal 0
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return False
    return start_ticks is None or int(fields[19]) == start_ticks


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _job_pid(attempt_dir: Path, job_id: str) -> int | None:
    """The job's process group id as the runner wrote it (None when it never got that far)."""
    try:
        return int(pid_path(attempt_dir, job_id).read_text())
    except (OSError, ValueError):
        return None


def _kill_group(pgid: int) -> bool:
    """SIGKILL a job's whole process group; False when it is already gone (or not ours)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False
