"""One case (a job, a run's attempt, a log) -> a Finding: verdict, the plan as it ran, memory picture, remedies.

The steps, each with what it needs and what it says when that is missing:
    1. the verdict: the classifier on the log tails (or pasted text) and the scheduler's record;
    2. the partition: ``--site`` (or the run's site) and the job's Slurm partition, else the site's
       partition whose GPU memory matches the capacity the OOM message states;
    3. the plan as it ran: the knobs found (plan.json, DeepSpeed config, job script, Trainer args),
       completed with defaults that are named as assumptions (picture.fill_plan);
    4. the model, when a config can be found (for the estimator);
    5. for an out-of-memory verdict: the memory picture and the ranked remedies; otherwise what the
       failure is and where to look, and no memory advice;
    6. for an out-of-memory verdict with the attempt's step series (metrics.json or the rank files next to
       the log): its data-driven case (toolkit/peaks.py). A long batch or a leak replaces the ladder's
       remedies by that case's own (a leak is fixed in the code, not by a smaller batch); and the allocator
       snapshot the job wrote on a CUDA OOM (toolkit/triage/snapshot.py), when there is one.
Nothing here raises for a bad log or a job that cannot be found: the Finding says what could not be read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..classify import Verdict, classify, classify_paths, usable_capacity_mib
from ..failures import hint_of
from ..errors import HpcmemError
from ..logtail import DEFAULT_MAX_BYTES
from ..sites import Partition, Site
from ..peaks import LEAK, LONG_BATCH
from .report import Finding

NON_TEXT_SHARE = 0.10
"""Share of replacement/control characters above which a log is called binary."""


def diagnose(case, site: Site | None, *, ledger=None, max_remedies: int = 5, partition: str | None = None,
             max_bytes: int = DEFAULT_MAX_BYTES) -> Finding:
    """The Finding for one ``sources.Case`` on ``site`` (None: no site profile, so no remedies that fit).

    ``ledger``: hpcmem's ledger, for a job that was an attempt of a run (its spec gives the submit command).
    ``partition``: the partition (profile or Slurm name) when the job's record does not say.
    """
    from .picture import fill_plan, memory_picture
    from .lookup import where_to_look
    from .remedies import remedies

    facts = case.facts
    notes: list[str] = []
    verdict = read_verdict(case, max_bytes, notes)
    said, partition = facts.partition or partition, None
    if site is not None:
        partition, note = pick_partition(site, said, verdict)
        if note:
            notes.append(note)
    elif verdict.is_oom:
        notes.append("no site profile given (--site): remedies cannot be checked against a partition")
    model, model_note = load_model(facts)
    try:
        known = fill_plan(facts.plan_knobs, partition, model)
    except HpcmemError as exc:
        notes.append(f"the plan read from the job's files does not hold together ({exc}); defaults assumed")
        known = fill_plan(None, partition, model)
    if facts.runtime or facts.accelerator_config:
        known = dataclasses.replace(known, runtime=dict(facts.runtime), accelerator_config=facts.accelerator_config)
    if known.note and verdict.is_oom:
        notes.append(known.note)
    if known.runtime.get("fsdp_no_sync") and known.plan.launcher == "fsdp" and known.plan.world_size > 1 \
            and known.plan.grad_accum > 1 and verdict.is_oom:
        notes.append("the estimate holds every FSDP unit's whole unsharded gradient between micro-batches: the job "
                     "accumulates under no_sync (its --accelerator_config does not ask for sync_each_batch)")
    if model_note and verdict.is_oom:
        notes.append(model_note)
    picture, found, look = None, (), ()
    moves = inflight_moves(case)
    recovered = verdict.is_oom and facts.state == "COMPLETED" and not facts.exit_code
    if recovered and moves:
        notes.append("the job completed (exit 0): hpcmem's in-job recovery answered the out-of-memory error in its "
                     "log inside the job with the same global batch (In-job moves); nothing to change, though a "
                     "next run can start from the plan the job ended with")
    elif recovered:
        notes.append("the job completed (exit 0): the out-of-memory error in its log was caught and recovered inside "
                     "the job (a retry with a smaller batch, an evaluation that skipped a batch); nothing to change")
        look = ("The job completed: if its results are wrong, the recovered out-of-memory error above is where its "
                "code changed course.",)
    elif verdict.is_oom:
        spec, base = run_spec(facts, ledger, partition)
        try:
            picture = memory_picture(verdict, known, partition, model, max_rss_mib=facts.max_rss_mib,
                                     mem_request_mib=_mem_request_mib(facts))
            if partition is not None:
                found = tuple(remedies(verdict, known, partition, model, spec=spec, site=site.name,
                                       max_items=max_remedies, base=base))
        except HpcmemError as exc:
            notes.append(f"no remedies: {exc}")
        hint = hint_of(verdict.kind, verdict.cause)
        if not found and hint:  # no plan move computed: the kind's direction, in words
            look = (f"{hint[:1].upper()}{hint[1:]}.",)
    else:
        look = tuple(where_to_look(verdict, facts.state))
    peak, snapshots = (data_peaks(case, known.plan.seq_len if known.known else None)
                       if verdict.is_oom and not recovered else (None, []))
    if peak is not None and peak.case in (LONG_BATCH, LEAK):
        found = ()  # this case's own remedies (peak.remedies) instead of the first-step ladder
    return Finding(target=case.target, source=case.kind, verdict=verdict, facts=facts, log_paths=tuple(case.log_paths),
                   site=site.name if site is not None else facts.site,
                   partition=partition.name if partition is not None else facts.partition,
                   plan=known.plan if known.known else None, plan_assumed=known.assumed, picture=picture,
                   remedies=found, where_to_look=look, notes=tuple(notes),
                   peaks=peak.to_dict() if peak is not None else None, memory_snapshots=tuple(snapshots),
                   inflight_moves=moves)


def inflight_moves(case) -> tuple:
    """The in-job moves recorded in the attempt directory next to the case's logs (rank 0's record first; every
    rank records the same agreed moves), () when there is none."""
    from ..runtime.metrics import attempt_rank_records

    for directory in dict.fromkeys(p.parent for p in case.log_paths):
        records = sorted(attempt_rank_records(directory), key=lambda r: r.get("rank") or 0)
        for record in records:
            moves = record.get("inflight_moves")
            if isinstance(moves, list) and moves:
                return tuple(m for m in moves if isinstance(m, dict))
    return ()


def data_peaks(case, plan_seq_len: int | None):
    """(peaks.PeakDiagnosis or None, [snapshot descriptions]) from the attempt directory next to the case's
    logs: the rank records' step series and the allocator snapshots the runtime wrote."""
    from ..peaks import diagnose as peaks_diagnose
    from ..runtime.metrics import attempt_rank_records
    from .snapshot import describe, find_snapshots

    for directory in dict.fromkeys(p.parent for p in case.log_paths):
        records = attempt_rank_records(directory)
        snapshots = [describe(p) for p in find_snapshots(directory)]
        if records or snapshots:
            return peaks_diagnose(records, plan_seq_len), snapshots
    return None, []


# --------------------------------------------------------------------------- 1. verdict


def read_verdict(case, max_bytes: int, notes: list[str], number_lines: bool = True) -> Verdict:
    """Classify the case's logs with its scheduler record; a log that cannot be read is a note, not an error.

    ``number_lines``: count a skipped head's lines so evidence line numbers are the file's own (a pass
    over the file; ``--since`` over many jobs does without).
    """
    record = {"state": case.facts.state, "exit_code": case.facts.exit_code, "signal": case.facts.signal}
    if case.log_text is not None:
        text = case.log_text
        _describe_text(text, "the pasted log", notes)
        return _shift_lines(classify(record, text), (case.log_first_line or 1) - 1)
    readable = []
    for path in case.log_paths:
        try:
            with open(path, "rb"):
                pass
            readable.append(path)
        except OSError as exc:
            notes.append(f"cannot read {path}: {exc.strerror or exc}")
    if not readable:
        return classify(record, "")
    try:
        verdict = classify_paths(readable, record, max_bytes, number_lines=number_lines)
    except HpcmemError as exc:  # logtail.LogError: unreadable or not a log
        notes.append(str(exc))
        return classify(record, "")
    if all(_is_empty(p) for p in readable):
        notes.append("the log is empty" if len(readable) == 1 else "the logs are empty")
    elif not verdict.evidence:
        _describe_files(readable, max_bytes, notes)
    return verdict


def _shift_lines(verdict: Verdict, offset: int) -> Verdict:
    """Line numbers counted from the start of a kept tail -> the input's own (``offset`` lines were skipped)."""
    if not offset:
        return verdict
    return dataclasses.replace(
        verdict, evidence=tuple((n + offset if n is not None else None, t) for n, t in verdict.evidence),
        ranks=tuple({**r, "line": r["line"] + offset} for r in verdict.ranks))


def _is_empty(path) -> bool:
    try:
        return path.stat().st_size == 0
    except OSError:
        return False


def _describe_files(paths, max_bytes: int, notes: list[str]) -> None:
    from ..logtail import read_tail

    for path in paths:
        try:
            tail = read_tail(path, min(max_bytes, 1 << 20))
        except HpcmemError:
            continue
        _describe_text(tail.text, str(path), notes)


def _describe_text(text: str, name: str, notes: list[str]) -> None:
    """A note when the text is not a text log (binary garbage) or is empty."""
    if not text.strip():
        notes.append(f"{name} is empty")
        return
    sample = text[-65536:]
    odd = sum(1 for c in sample if c == "\ufffd" or (ord(c) < 32 and c not in "\n\r\t"))
    if odd > NON_TEXT_SHARE * len(sample):
        notes.append(f"{name} does not look like a text log ({100 * odd / len(sample):.0f} % binary characters)")


# --------------------------------------------------------------------------- 2. partition


def pick_partition(site: Site, slurm_partition: str | None, verdict: Verdict) -> tuple[Partition | None, str]:
    """The site's partition the job ran on, and a note when it was inferred.

    By profile name first, then by Slurm partition name; several profiles may share one Slurm partition
    (V100 16 GB and 32 GB nodes behind ``gpu_v100``): then the one whose GPU memory matches the capacity
    the OOM message states, so a remedy is never checked against a smaller card than the job had. Without a
    name, the GPU partition closest to the stated capacity.
    """
    capacity = usable_capacity_mib(verdict.numbers)  # a memory-fraction cap emulates the smaller card
    names = [n.strip() for n in (slurm_partition or "").split(",") if n.strip()]
    for name in names:
        if name in site.partitions:
            return site.partitions[name], ""
    for name in names:
        sharing = [p for p in site.partitions.values()  # a profile may name several: "gpu,gpu-long"
                   if name in (x.strip() for x in (p.slurm_partition or "").split(","))]
        if len(sharing) == 1:
            return sharing[0], ""
        if sharing:
            if capacity:
                part = _closest_capacity(sharing, capacity)
                return part, (f"partition {part.name} assumed: of the profiles behind Slurm partition {name} "
                              f"({', '.join(p.name for p in sharing)}), its {part.gpu_mem_gib:g} GiB GPUs match the "
                              f"{capacity / 1024:.1f} GiB the message states")
            part = min(sharing, key=lambda p: p.gpu_mem_gib)
            return part, (f"partition {part.name} assumed: the smallest of the profiles behind Slurm partition {name} "
                          f"({', '.join(p.name for p in sharing)}); give the right one with --partition")
    gpus = [p for p in site.partitions.values() if p.has_gpu]
    if capacity and gpus:
        part = _closest_capacity(gpus, capacity)
        return part, (f"partition {part.name} assumed: its {part.gpu_mem_gib:g} GiB GPUs are the closest to the "
                      f"{capacity / 1024:.1f} GiB the message states")
    if len(site.partitions) == 1:
        return next(iter(site.partitions.values())), ""
    if names:
        return None, f"partition {slurm_partition!r} is not in site {site.name}'s profile"
    return None, (f"which partition of site {site.name} the job ran on is not known: give it with --partition "
                  f"({', '.join(sorted(site.partitions))})")


def _closest_capacity(parts: list[Partition], capacity_mib: float) -> Partition:
    """The partition whose GPUs match a stated capacity: the smallest not below it (a card reports a little less
    than its nominal size, hence 0.9), else the largest."""
    fitting = [p for p in parts if p.gpu_mem_gib * 1024 >= 0.9 * capacity_mib]
    if fitting:
        return min(fitting, key=lambda p: p.gpu_mem_gib)
    return max(parts, key=lambda p: p.gpu_mem_gib)


# --------------------------------------------------------------------------- 3. the run's spec


def run_spec(facts, ledger, partition: Partition | None) -> tuple[str | None, Any]:
    """For an attempt of an hpcmem run: the spec to resubmit and the plan `hpcmem submit SPEC` starts from.

    Remedies give their ``--set`` knobs relative to that plan, so the command reproduces every earlier move.
    (None, None) when the job was not an hpcmem attempt or its spec cannot be read any more.
    """
    if not facts.run_id or ledger is None or partition is None:
        return None, None
    from ..runs import spec_for

    try:
        run = ledger.run(facts.run_id)
        spec = spec_for(run)  # the spec as recorded with the run, never the user's (maybe edited) file
        return run.spec_path, spec.first_plan(partition)
    except (HpcmemError, OSError, KeyError):
        return None, None


# --------------------------------------------------------------------------- 4. model


def load_model(facts) -> tuple[Any, str]:
    """The ModelRef for the job's model config, or (None, why not)."""
    if not facts.model:
        return None, "the model is not known (no model config found): memory is predicted from the message's numbers"
    from ..estimate import model_ref

    try:
        return model_ref(facts.model, facts.task or "causal-lm"), ""
    except HpcmemError as exc:
        return None, f"model {facts.model}: {exc}"


def _mem_request_mib(facts) -> float | None:
    from ..backends.slurm import parse_mem_mib

    for tres in (facts.alloc_tres, facts.req_tres):
        if tres and tres.get("mem"):
            return parse_mem_mib(str(tres["mem"]), default_unit="M")
    return None
