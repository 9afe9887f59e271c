"""The OOM-retry controller: a durable state machine over the ledger.

``tick(run)`` advances a run by one step and returns; it is safe to kill at any
moment and safe to run twice at once:

- one step per run at a time (``runs.run_lock``; a second ticker skips the run);
- every step is written to the ledger before it is acted on. An attempt is
  ``planned`` (its plan recorded) before anything is rendered or submitted, ``submitting`` right before sbatch, and gets its
  job id right after. A tick that finds ``submitting`` without a job id looks the
  job up by its unique Slurm name (``<spec>.<run>.a<n>``) before submitting again,
  so a controller killed between sbatch and the ledger never submits twice;
- the next plan is a pure function of what is recorded (``ladder.next_plan``), so
  a controller killed while deciding decides the same again.

Attempt states: ``planned`` (recorded; its files are rendered when it is submitted),
``submitting``, the scheduler's (PENDING, RUNNING,
COMPLETED, FAILED, OUT_OF_MEMORY, ...), ``submit_failed`` and ``LOST`` (the
scheduler forgot the job). Run states: running, succeeded, failed, gave_up, cancelled.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable, Mapping

from . import peaks, render, runs
from .backends import get_backend
from .backends.base import JobStatus, fault
from .classify import Verdict, classify, classify_paths
from .errors import HpcmemError, MaybeSubmittedError, SchedulerError
from .estimate import estimate, spec_model
from .failures import is_host
from .jobspec import JobSpec
from .ladder import HOST_RESERVE_SHARE, Decision, next_plan, size_for_long_batch
from .ledger import AttemptRow, Ledger, Run
from .plan import Plan
from .resources import env_number
from .runtime import inflight
from .sites import Partition, Site

TRANSIENT_STATES = ("NODE_FAIL", "BOOT_FAIL", "PREEMPTED")


def lost_after_s() -> float:
    """A job the scheduler has not known for this long after submission is LOST; so is an attempt whose
    submission stayed uncertain (sbatch timing out, the controller unreachable, no job by its name) that long.
    ``$HPCMEM_LOST_AFTER_S``, 900 s by default."""
    return env_number("HPCMEM_LOST_AFTER_S", 900.0)


__all__ = ["start", "tick", "tick_all", "follow", "cancel", "fault", "attempt_verdict", "lost_after_s"]


def start(ledger: Ledger, spec: JobSpec, site: Site, partition: Partition, plan: Plan, **kwargs) -> Run:
    """Record a new run with its first attempt planned, then take its first step (render and submit)."""
    run = runs.create_run(ledger, spec, site, partition, plan, **kwargs)
    fault("after_plan")
    return tick(ledger, run.run_id)


def tick(ledger: Ledger, run_id: str) -> Run:
    """Advance one run by one step (submit, poll, decide); returns the run as recorded."""
    run = ledger.run(run_id)
    if run.state in runs.TERMINAL_RUN_STATES:
        return run
    with runs.run_lock(run) as mine:
        if mine:
            _step(ledger, ledger.run(run_id))
    return ledger.run(run_id)


def tick_all(ledger: Ledger) -> list[Run]:
    """One step for every unfinished run (what cron calls); a failing run does not stop the others."""
    out = []
    for run in ledger.runs(states=("running",)):
        try:
            out.append(tick(ledger, run.run_id))
        except HpcmemError as exc:
            ledger.add_event(run.run_id, None, f"tick failed: {exc}")
            out.append(ledger.run(run.run_id))
    return out


def _step(ledger: Ledger, run: Run) -> None:
    if run.state != "running":
        return
    site = runs.load_site_for(run)
    backend = get_backend(site.scheduler)
    last = ledger.attempts(run.run_id)[-1]
    if last.state == "planned":
        _render(ledger, run, last, site)
        _submit(ledger, run, last, backend)
    elif last.state == "submitting":
        try:
            job_id = backend.find(_job_name(run, last), Path(last.attempt_dir))
        except SchedulerError as exc:
            if not _give_up_submitting(ledger, run, last, exc):
                raise
            return
        if job_id:
            ledger.add_event(run.run_id, last.n, f"found job {job_id} submitted before a crash")
            ledger.update_attempt(run.run_id, last.n, job_id=job_id, state="PENDING", submitted=time.time())
        else:
            if not (Path(last.attempt_dir) / "job.sbatch").is_file():
                _render(ledger, run, last, site)  # a crash came before its files were complete
            _submit(ledger, run, last, backend)
    elif not runs.finished(last.state):
        _poll(ledger, run, last, backend)
    else:
        _decide(ledger, run, last, site)


def _job_name(run: Run, attempt: AttemptRow) -> str:
    return render.job_name(run.spec_name, run.run_id, attempt.n)


def _render(ledger: Ledger, run: Run, attempt: AttemptRow, site: Site) -> None:
    """Write the attempt's files from its recorded plan (again, if a crash interrupted the first time),
    from the spec as recorded with the run; then its record in the run directory (``attempt.json``)."""
    fault("before_render")
    try:
        render.render_attempt(runs.spec_for(run), site.partition(attempt.partition), Plan.from_dict(attempt.plan),
                              Path(attempt.attempt_dir), run_id=run.run_id, attempt=attempt.n, workdir=Path(run.workdir))
        runs.write_attempt_record(attempt)
    except HpcmemError as exc:
        ledger.update_attempt(run.run_id, attempt.n, state="submit_failed")
        runs.end_run(ledger, run, "failed", f"attempt {attempt.n} could not be rendered: {exc}")
        raise
    fault("after_render")


def _submit(ledger: Ledger, run: Run, attempt: AttemptRow, backend) -> None:
    # ``submitted`` holds when the submission began until the job id is known: it bounds an uncertain one
    ledger.update_attempt(run.run_id, attempt.n, state="submitting", submitted=attempt.submitted or time.time())
    fault("before_sbatch")
    try:
        job_id = backend.submit(Path(attempt.attempt_dir) / "job.sbatch", Path(attempt.attempt_dir))
    except MaybeSubmittedError as exc:  # stay 'submitting': the next tick looks the job up by name
        ledger.add_event(run.run_id, attempt.n, f"submission uncertain, will look for the job: {exc}")
        if not _give_up_submitting(ledger, run, ledger.attempts(run.run_id)[attempt.n - 1], exc):
            raise
        return
    except SchedulerError as exc:
        ledger.update_attempt(run.run_id, attempt.n, state="submit_failed")
        runs.end_run(ledger, run, "failed", f"attempt {attempt.n} was refused: {exc}")
        raise
    fault("after_sbatch")
    ledger.update_attempt(run.run_id, attempt.n, job_id=job_id, state="PENDING", submitted=time.time())


def _give_up_submitting(ledger: Ledger, run: Run, attempt: AttemptRow, exc: Exception) -> bool:
    """An attempt whose submission stayed uncertain for ``lost_after_s()`` becomes LOST (the run fails); True if so."""
    since = attempt.submitted
    if since is None or time.time() - since <= lost_after_s():
        return False
    ledger.update_attempt(run.run_id, attempt.n, state="LOST", finished=time.time(),
                          verdict=classify(None, "").to_dict())
    runs.end_run(ledger, run, "failed", f"attempt {attempt.n} could not be submitted for {time.time() - since:.0f} s "
                                        f"and no job of its name exists: {exc}")
    return True


def _poll(ledger: Ledger, run: Run, attempt: AttemptRow, backend) -> None:
    try:
        status = backend.poll([attempt.job_id])[attempt.job_id]
    except SchedulerError as exc:
        ledger.add_event(run.run_id, attempt.n, f"poll failed, will retry: {exc}")
        return
    fault("after_poll")
    if status.state == "UNKNOWN":
        if attempt.submitted and time.time() - attempt.submitted > lost_after_s():
            ledger.update_attempt(run.run_id, attempt.n, state="LOST", finished=time.time(),
                                  verdict=classify(None, "").to_dict())
            runs.end_run(ledger, run, "failed", f"the scheduler no longer knows job {attempt.job_id}")
        return
    if status.finished:
        _record_end(ledger, run, attempt, status)
    elif status.state != attempt.state:
        ledger.update_attempt(run.run_id, attempt.n, state=status.state)


def _record_end(ledger: Ledger, run: Run, attempt: AttemptRow, status: JobStatus) -> None:
    """Write the end of an attempt: state, exit code, verdict, metrics (the decision comes next tick)."""
    attempt_dir = Path(attempt.attempt_dir)
    verdict = attempt_verdict(attempt_dir, status)
    if status.max_rss_mib is not None and is_host(verdict):  # the scheduler's own measure, kept for the decision
        verdict = dataclasses.replace(verdict, numbers={**verdict.numbers, "max_rss_mib": float(status.max_rss_mib)})
    fields = {"state": status.state, "exit_code": status.exit_code, "finished": time.time(),
              "verdict": verdict.to_dict()}
    metrics = runs.read_metrics(attempt_dir)
    if metrics is not None:
        fields["metrics"] = metrics
    ledger.update_attempt(run.run_id, attempt.n, **fields)


def attempt_verdict(attempt_dir: Path, status) -> Verdict:
    """Why an attempt ended: the classifier over its logs and the scheduler's record."""
    logs = sorted(attempt_dir.glob("slurm-*.out"))
    return classify_paths(logs, record=status) if logs else classify(status, "")


def _decide(ledger: Ledger, run: Run, last: AttemptRow, site: Site) -> None:
    """The last attempt is over: succeed, stop, give up, or prepare the next attempt."""
    if last.state in ("submit_failed", "LOST"):
        return  # the run state was set when this happened
    if last.state == "COMPLETED" and not last.exit_code:
        runs.end_run(ledger, run, "succeeded")
        return
    spec = runs.spec_for(run)
    verdict = Verdict.from_dict(last.verdict) if last.verdict else classify(None, "")
    attempts = ledger.attempts(run.run_id)
    partition = site.partition(last.partition)
    if not verdict.is_oom:
        resume = resume_decision(spec.resume, last, attempts, partition)
        if resume.action == "retry":
            ledger.add_attempt(run.run_id, last.n + 1, resume.plan.to_dict(), _attempt_dir(run, last.n + 1),
                               partition.name, resume.to_dict())
            return
        if spec.retry_transient and last.state in TRANSIENT_STATES and not _retried_transient(attempts):
            retry = Decision(action="retry", plan=Plan.from_dict(last.plan), partition=partition,
                             moves=("transient-retry",), reason=f"{last.state} is a node failure; one retry as is")
            ledger.add_attempt(run.run_id, last.n + 1, retry.plan.to_dict(), _attempt_dir(run, last.n + 1),
                               partition.name, retry.to_dict())
            return
        why = f" {resume.reason}" if resume.reason else ""
        runs.end_run(ledger, run, "failed", f"attempt {last.n} (job {last.job_id}) ended {last.state}: "
                     f"{verdict.reason} Not a memory failure: not retried.{why}")
        return
    ended = ended_plan(last)  # with the job's in-job moves: the next plan starts from what the job ended with
    confirmed, why = host_oom_confirmed(verdict, ended.mem_mib or partition.default_mem_mib)
    if not confirmed:
        runs.end_run(ledger, run, "failed", f"attempt {last.n} (job {last.job_id}) ended {last.state}: "
                     f"{verdict.reason.rstrip('.')}. Not retried: {why}. {verdict.confirm}".rstrip())
        return
    peak = data_peak(last)  # data-driven peaks (toolkit/peaks.py): a leak is not retried, a long batch is sized for
    if peak is not None and peak.case == peaks.LEAK:
        runs.end_run(ledger, run, "gave_up", peaks.give_up_reason(peak, last.n, last.job_id))
        return
    usual_seq_len, ended = ended.seq_len, peaks.plan_for_ladder(ended, peak)
    tried = [(plan, site.partition(a.partition)) for a in attempts
             for plan in dict.fromkeys((Plan.from_dict(a.plan), ended_plan(a)))]
    bigger = [p for p in site.partitions.values() if p.has_gpu == partition.has_gpu and p.name != partition.name
              and (p.gpu_mem_gib, p.host_mem_gib) > (partition.gpu_mem_gib, partition.host_mem_gib)]
    decision = next_plan(ended, verdict, partition, allow=spec.allow, tried=tried,
                         attempts_made=len([a for a in attempts if not _resumed(a)]), max_attempts=spec.max_attempts,
                         bigger=bigger,
                         model=_estimator_model(spec, partition))
    decision = size_for_long_batch(decision, peak, usual_seq_len,
                                   mem_cap_mib=partition.host_mem_gib * 1024 * (1 - HOST_RESERVE_SHARE))
    if decision.action == "retry":
        ledger.add_attempt(run.run_id, last.n + 1, decision.plan.to_dict(), _attempt_dir(run, last.n + 1),
                           decision.partition.name, decision.to_dict())
        fault("after_decide")
    elif decision.action == "give_up":
        runs.end_run(ledger, run, "gave_up", decision.reason)
    else:
        runs.end_run(ledger, run, "failed", f"attempt {last.n} (job {last.job_id}): {decision.reason}")


HOST_CONFIRM_SHARE = 0.9
"""A host OOM the log only suggests (a lone SIGKILL: confidence below high) is retried when the scheduler saw the
job use at least this share of its --mem (sacct MaxRSS): memory it was, so a memory move is the answer."""


def host_oom_confirmed(verdict: Verdict, limit_mib: float | None) -> tuple[bool, str]:
    """Whether a memory move may answer ``verdict`` (pure). Only host-memory verdicts below high confidence are
    checked: they need the scheduler's record to agree (``max_rss_mib``, stored from sacct when the attempt ended,
    at least ``HOST_CONFIRM_SHARE`` of ``limit_mib``, the job's --mem). A MaxRSS below it proves nothing either
    way (sacct samples and can miss the peak), so the run stops and says what would settle it."""
    if not verdict.is_oom or verdict.confidence == "high" or not is_host(verdict):
        return True, ""
    rss = verdict.numbers.get("max_rss_mib")
    if rss is None or not limit_mib:
        return False, "the log alone suggests host memory (confidence " + verdict.confidence + \
            ") and the scheduler recorded no MaxRSS against a known --mem to confirm it"
    if rss >= HOST_CONFIRM_SHARE * limit_mib:
        return True, ""
    return False, (f"the scheduler saw at most {rss:.0f} MiB of the {limit_mib:.0f} MiB --mem, which does not "
                   f"confirm a host OOM (confidence {verdict.confidence})")


def _estimator_model(spec: JobSpec, partition: Partition):
    """The spec's model for the ladder's predictor (toolkit/predict.py) when the estimator can read it on a GPU
    partition (else None: the predictor's numbers-only model)."""
    if not partition.has_gpu or not spec.model.get("config"):
        return None
    try:
        ref = spec_model(spec)
        probe = Plan(attention="eager")  # every model runs eager (Gemma 2 has no SDPA path)
        estimate(ref, probe, partition)  # a model the analytic method does not cover fails here, not mid-ladder
    except (HpcmemError, KeyError, TypeError, ValueError):
        return None
    return ref


def data_peak(attempt: AttemptRow):
    """The data-driven case (``peaks.PeakDiagnosis``) the attempt's step series shows, read from its directory
    (metrics.json, else the rank files a killed job left); None without a series."""
    from .runtime.metrics import attempt_rank_records

    return peaks.diagnose(attempt_rank_records(attempt.attempt_dir), Plan.from_dict(attempt.plan).seq_len)


def _attempt_dir(run: Run, n: int) -> str:
    return str(Path(run.run_dir) / f"attempt-{n}")


RESUME_MOVE = "resume"


def resume_decision(allowed: Mapping[str, int], last: AttemptRow, attempts: list[AttemptRow],
                    partition: Partition) -> Decision:
    """After a scheduler ending that loses no memory verdict (TIMEOUT, PREEMPTED): resubmit the same plan to
    resume from the run's checkpoint (pure on the recorded attempts). Only when the spec allows another one for
    that state (``retry.resume``) and the attempt saved a checkpoint newer than the one it resumed from, so a job
    that makes no progress is never resubmitted for ever. ``stop`` with the reason otherwise ("" when the state
    is not resumable at all)."""
    stop = Decision(action="stop", plan=None, partition=partition)
    if last.state not in allowed:
        return stop
    used = sum(1 for a in attempts if _resumed(a) == last.state)
    if used >= allowed[last.state]:
        return Decision("stop", None, partition, reason=f"{used} resume(s) after {last.state} already made "
                                                         f"(retry.resume allows {allowed[last.state]})")
    facts = runs.resume_facts(last)
    saved = (facts["checkpoint"] or {}).get("step")
    start = facts["resumed_from_step"] or 0
    if not saved or saved <= start:
        return Decision("stop", None, partition, reason=f"it left no checkpoint newer than step {start} to resume from")
    return Decision("retry", ended_plan(last), partition, moves=(f"{RESUME_MOVE}:{last.state}",),
                    reason=f"{last.state}: resuming from the checkpoint of step {saved}")


def ended_plan(attempt: AttemptRow) -> Plan:
    """The plan an attempt ended with: its recorded plan with the in-job moves its metrics (or rank files) record
    (docs/resume.md "In-job recovery"), so a resubmit never tries again what already failed inside the job."""
    return inflight.plan_after_moves(Plan.from_dict(attempt.plan), runs.resume_facts(attempt)["inflight_moves"])


def _resumed(attempt: AttemptRow) -> str | None:
    """The scheduler state an attempt was resubmitted to resume after (None for every other attempt)."""
    for move in (attempt.decision or {}).get("moves", ()):
        if move.startswith(RESUME_MOVE + ":"):
            return move.split(":", 1)[1]
    return None


def _retried_transient(attempts: list[AttemptRow]) -> bool:
    return any(a.decision and "transient-retry" in a.decision.get("moves", ()) for a in attempts)


def follow(ledger: Ledger, run_id: str, *, interval_s: float = 2.0,
           on_change: Callable[[Run, list[AttemptRow]], None] | None = None, timeout_s: float | None = None) -> Run:
    """Tick until the run ends (or ``timeout_s`` passes), calling ``on_change`` after each tick.

    A scheduler hiccup does not end the loop: the tick is tried again next time.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            run = tick(ledger, run_id)
        except SchedulerError as exc:
            ledger.add_event(run_id, None, f"tick failed, will retry: {exc}")
            run = ledger.run(run_id)
            if run.state != "running":
                raise
        if on_change:
            on_change(run, ledger.attempts(run_id))
        if run.state in runs.TERMINAL_RUN_STATES or (deadline and time.monotonic() > deadline):
            return run
        last = ledger.attempts(run_id)[-1]
        ours = last.state in ("planned", "submitting") or runs.finished(last.state)
        time.sleep(0.1 if ours else interval_s)  # the next step is ours to take: no need to wait for the scheduler


def cancel(ledger: Ledger, run_id: str) -> Run:
    """Cancel a run: mark it cancelled under its lock (no new attempt can start), then cancel its job in flight."""
    run = ledger.run(run_id)
    if run.state in runs.TERMINAL_RUN_STATES:
        return run
    with runs.run_lock(run, wait_s=60) as mine:
        if not mine:
            raise HpcmemError(f"run {run_id} is busy (a controller holds it); try again")
        runs.end_run(ledger, run, "cancelled", "cancelled by the user")
        live = [a for a in ledger.attempts(run_id) if not runs.finished(a.state)]
        backend = get_backend(runs.load_site_for(run).scheduler)
        for a in live:
            job_id = a.job_id or backend.find(_job_name(run, a), Path(a.attempt_dir))
            if job_id:
                backend.cancel([job_id])
            ledger.update_attempt(run_id, a.n, job_id=job_id, state="CANCELLED", finished=time.time())
    return ledger.run(run_id)
