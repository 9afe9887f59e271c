"""Data-driven peaks: why a job ran out of memory hours in, from the steps it recorded (issue 14, pure, no I/O).

The runtime records, per rank, each optimizer step's sequence length (the longest in the batch) and peak memory
(``step_peaks`` in the rank records of metrics.json, shape below). ``diagnose`` tells three cases apart:

``long_batch``  the step that failed carried a batch longer than the plan's ``seq_len`` and longer than every step
                that completed: memory that scales with the length (activations, attention) was larger than any
                step before. Remedy: cap the length (truncate), bucket batches by length, or size the plan for the
                longest batch (``hpcmem plan --max-seq-len N``). Not a leak, and not a plan that never fit.
``leak``        the per-step peak grows step after step (same-length steps only, the first ``SKIP_STEPS`` left
                out): a Theil-Sen slope (the median of all pairwise slopes, so one odd step cannot make or hide
                a trend) with Kendall's tau at least ``LEAK_MIN_TAU``, and growth over the window of at least
                ``LEAK_MIN_MIB`` and ``LEAK_MIN_SHARE`` of the median peak. Remedy: the code (a tensor kept
                across steps, typically ``total += loss`` keeping each step's graph: ``loss.item()`` or
                ``loss.detach()``); a smaller batch only moves the failure later.
``first_step``  the attempt failed in its first step: the plan itself does not fit; the first-step ladder applies.
``None``        a failure mid-run that neither explains (no step series, a fixed allocation at step N, ...): the
                ordinary ladder applies.

Thresholds (docs/resume.md "Data-driven peaks" says why these and what was measured):
- long batch: no ratio is fitted. A length above the plan's ``seq_len`` is outside what the plan was sized for,
  and a length no completed step reached is the one new thing at the failing step; both must hold.
- leak: ``LEAK_MIN_TAU`` 0.6 means 80 % of step pairs ordered the same way as time (a flat series with noise has
  tau near 0); ``LEAK_MIN_MIB`` and ``LEAK_MIN_SHARE`` keep allocator and RSS jitter (a few MiB between steps of a
  steady loop) from counting as a trend; ``LEAK_MIN_POINTS`` is the fewest steps a slope is fitted on.

Step series shape (``toolkit/runtime/monitor.py`` writes it; bounded, see ``SeriesRecorder``)::

    {"measure": "rss" | "max_memory_allocated", "plan_seq_len": 128, "first_step": 1, "every": 1,
     "steps": [[step, seq_len, peak_mib], ...],        # every ``every``-th completed step, at most ``cap``
     "last": [step, seq_len, peak_mib] | null,          # the last completed step, always
     "longest_done": [step, seq_len] | null,            # the longest batch that completed, exactly
     "current": {"step": n, "seq_len": L} | null}       # a step begun and not ended (the failing one)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .errors import ConfigError

LONG_BATCH, LEAK, FIRST_STEP = "long_batch", "leak", "first_step"
CASES = (LONG_BATCH, LEAK, FIRST_STEP)

SKIP_STEPS = 3
"""Completed steps of an attempt left out of the trend: the first steps allocate the optimizer state, the
allocator's pools and the autograd caches, so their peaks rise without any leak."""
LEAK_MIN_POINTS = 6
LEAK_MIN_TAU = 0.6
LEAK_MIN_MIB = 32.0
LEAK_MIN_SHARE = 0.05

SERIES_CAP = 1024
"""Most entries a rank's step series keeps (about 30 KB of JSON): a 1M-step run keeps every 1024th step."""


@dataclass(frozen=True)
class PeakDiagnosis:
    """What the step series says about an out-of-memory failure."""

    case: str | None
    """``long_batch``, ``leak``, ``first_step`` or None (the series explains nothing special)."""
    reason: str = ""
    """One sentence for a person."""
    evidence: tuple = ()
    """Sentences with the numbers the case rests on."""
    remedies: tuple = ()
    """What fixes this case, best first (sentences; commands quoted)."""
    numbers: dict = field(default_factory=dict)
    """step, seq_len, plan_seq_len, longest_done, slope_mib_per_step, tau, growth_mib, ... (what applies)."""
    rank: int | None = None
    """The rank whose series shows it."""
    measure: str | None = None
    """What the series' peaks measure: ``rss`` (host memory) or ``max_memory_allocated`` (a GPU's)."""

    @property
    def answers_with_ladder(self) -> bool:
        """True when the ordinary OOM ladder (a smaller micro-batch, ...) is a fitting answer."""
        return self.case != LEAK

    def to_dict(self) -> dict[str, Any]:
        return {"case": self.case, "reason": self.reason, "evidence": list(self.evidence),
                "remedies": list(self.remedies), "numbers": dict(self.numbers), "rank": self.rank,
                "measure": self.measure}


# --------------------------------------------------------------------------- recording (used by the runtime)


class SeriesRecorder:
    """A rank's bounded step series (pure bookkeeping: the caller measures).

    Keeps every ``every``-th completed step; when ``cap`` entries are held, every other one is dropped and
    ``every`` doubles, so the kept steps stay evenly spaced and the series never exceeds ``cap`` entries.
    The last completed step, the longest completed batch and the step in progress are kept exactly.
    """

    def __init__(self, measure: str, plan_seq_len: int | None = None, cap: int = SERIES_CAP):
        if cap < 2:
            raise ValueError("cap must be at least 2")
        self.measure, self.plan_seq_len, self.cap = measure, plan_seq_len, cap
        self.every = 1
        self.entries: list[list] = []
        self.first_step: int | None = None
        self.last: list | None = None
        self.longest_done: list | None = None
        self.current: dict | None = None
        self._count = 0

    def begin(self, step: int, seq_len: int | None) -> bool:
        """A step begins; True when its batch is longer than every completed one (worth writing down now)."""
        if self.first_step is None:
            self.first_step = int(step)
        self.current = {"step": int(step), "seq_len": None if seq_len is None else int(seq_len)}
        return seq_len is not None and (self.longest_done is None or seq_len > self.longest_done[1])

    def end(self, peak_mib: float | None) -> None:
        """The step in progress completed with this peak (MiB)."""
        if self.current is None:
            return
        step, seq_len = self.current["step"], self.current["seq_len"]
        self.current = None
        entry = [step, seq_len, None if peak_mib is None else round(float(peak_mib), 1)]
        self.last = entry
        if seq_len is not None and (self.longest_done is None or seq_len > self.longest_done[1]):
            self.longest_done = [step, seq_len]
        if self._count % self.every == 0:
            self.entries.append(entry)
            if len(self.entries) >= self.cap:
                self.entries = self.entries[::2]
                self.every *= 2
        self._count += 1

    def to_dict(self) -> dict[str, Any]:
        return {"measure": self.measure, "plan_seq_len": self.plan_seq_len, "first_step": self.first_step,
                "every": self.every, "cap": self.cap, "steps": [list(e) for e in self.entries], "last": self.last,
                "longest_done": self.longest_done, "current": dict(self.current) if self.current else None}


# --------------------------------------------------------------------------- analysis


def diagnose(records: Iterable[Mapping[str, Any]], plan_seq_len: int | None = None) -> PeakDiagnosis | None:
    """The case the ranks' step series show, or None when no rank recorded a series.

    ``records``: rank records (each with ``rank`` and ``step_peaks``). ``plan_seq_len``: the plan's, used where
    a series does not say (the series' own is what the run was given). A long batch on any rank wins (it names the failing step), then a leak on any rank, then a first-step
    failure; otherwise a PeakDiagnosis with case None (a series was read and shows nothing special).
    """
    found = []
    for record in records:
        series = record.get("step_peaks") if isinstance(record, Mapping) else None
        if isinstance(series, Mapping):
            rank = record.get("rank")
            found.append(analyse(series, plan_seq_len, rank=rank if isinstance(rank, int) else None))
    if not found:
        return None
    for case in CASES:
        hits = [d for d in found if d.case == case]
        if hits:
            return hits[0]
    return found[0]


def analyse(series: Mapping[str, Any], plan_seq_len: int | None = None, rank: int | None = None) -> PeakDiagnosis:
    """One rank's series -> its case (see the module docstring); ``plan_seq_len`` where the series has none."""
    seq = _int(series.get("plan_seq_len"))
    seq = seq if seq is not None else plan_seq_len
    steps = [e for e in (series.get("steps") or []) if _entry(e)]
    current = series.get("current") if isinstance(series.get("current"), Mapping) else None
    longest = series.get("longest_done")
    longest_len = _int(longest[1]) if isinstance(longest, (list, tuple)) and len(longest) == 2 else None
    if longest_len is None:
        lens = [e[1] for e in steps if e[1] is not None]
        longest_len = max(lens) if lens else None
    measure = series.get("measure") or "peak"

    if current is not None:
        cur_step, cur_len = _int(current.get("step")), _int(current.get("seq_len"))
        if cur_len is not None and seq is not None and cur_len > seq and (longest_len is None or cur_len > longest_len):
            return _long_batch(cur_step, cur_len, seq, longest, longest_len, rank, steps, measure)

    leak = _leak(steps, seq, measure, rank)
    if leak is not None:
        return leak

    completed = series.get("last") is not None or bool(steps)
    if current is not None and not completed:
        step = _int(current.get("step"))
        return PeakDiagnosis(FIRST_STEP, f"out of memory in the attempt's first step (step {step}): the plan itself "
                                         "does not fit", (f"no step of this attempt completed; step {step} was the "
                                                          "first",),
                             ("make the plan fit: the out-of-memory ladder's moves (smaller micro-batch, "
                              "checkpointing, sharding, offload, more memory)",), {"step": step}, rank, measure)
    return PeakDiagnosis(None, "the step series shows neither a long batch nor growing memory", (), (),
                         {"steps_recorded": len(steps)}, rank, measure)


def _long_batch(step, length, seq, longest, longest_len, rank, steps, measure) -> PeakDiagnosis:
    ratio = length / seq
    usual = [e[2] for e in steps if e[2] is not None]
    done = (f"the longest batch that completed was {longest_len} tokens (step {longest[0]})"
            if longest_len is not None and isinstance(longest, (list, tuple)) else "no step of this attempt completed")
    return PeakDiagnosis(
        LONG_BATCH,
        f"step {step}'s batch was {length} tokens, {ratio:.1f}x the plan's seq_len {seq}",
        (f"step {step} (the failing step) had a batch of {length} tokens; the plan was sized for seq_len {seq}",
         done + "; memory that scales with the length (activations, attention) had never been this large"),
        (f"cap the sequence length at {seq} tokens (truncate longer samples in the data pipeline)",
         "bucket batches by length (e.g. a length-grouped sampler) so no batch is padded far past the typical length",
         f"or size the plan for the longest batch: hpcmem plan JOB --max-seq-len {length} "
         "(or --seq-len-hist FILE with the data's length histogram)"),
        {"step": step, "seq_len": length, "plan_seq_len": seq, "ratio": round(ratio, 3),
         "longest_done": longest_len, "usual_peak_mib": max(usual) if usual else None}, rank, measure)


def _leak(steps: Sequence[list], seq: int | None, measure: str, rank) -> PeakDiagnosis | None:
    # Same-length steps only (a longer batch legitimately peaks higher); the first SKIP_STEPS left out.
    usual = [e for e in steps if e[2] is not None and (seq is None or e[1] is None or e[1] <= seq)]
    points = [(float(e[0]), float(e[2])) for e in usual[SKIP_STEPS:]]
    if len(points) < LEAK_MIN_POINTS:
        return None
    slope = theil_sen_slope(points)
    tau = kendall_tau(points)
    span = points[-1][0] - points[0][0]
    growth = slope * span
    base = _median([p for _, p in points])
    floor = max(LEAK_MIN_MIB, LEAK_MIN_SHARE * base)
    if tau < LEAK_MIN_TAU or growth < floor:
        return None
    first, last = points[0], points[-1]
    what = "resident memory (RSS)" if measure == "rss" else f"peak memory ({measure})"
    return PeakDiagnosis(
        LEAK,
        f"{what} grew {slope:.1f} MiB per step, step after step, from {first[1]:.0f} MiB at step "
        f"{first[0]:.0f} to {last[1]:.0f} MiB at step {last[0]:.0f}",
        (f"{len(points)} steps after the first {SKIP_STEPS}: Theil-Sen slope {slope:.2f} MiB/step, Kendall tau "
         f"{tau:.2f} (>= {LEAK_MIN_TAU} is a steady rise), growth {growth:.0f} MiB over {span:.0f} steps "
         f"(threshold {floor:.0f} MiB)",
         "a steady training loop's per-step peak is flat once its first steps have allocated the optimizer state"),
        ("fix the code: something keeps a tensor from every step, most often an accumulated loss that keeps its "
         "autograd graph (`total += loss`): accumulate `loss.item()` or `loss.detach()` instead; also lists or "
         "dicts of outputs, metrics kept as tensors, hooks that store activations",
         "a smaller micro-batch or more memory only moves the failure to a later step: hpcmem does not retry it"),
        {"slope_mib_per_step": round(slope, 3), "tau": round(tau, 3), "growth_mib": round(growth, 1),
         "from_step": int(first[0]), "to_step": int(last[0]), "from_mib": first[1], "to_mib": last[1],
         "points": len(points)}, rank, measure)


def theil_sen_slope(points: Sequence[tuple[float, float]]) -> float:
    """The median of the slopes of all pairs with distinct x (0.0 with fewer than two such points)."""
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1:] if x2 != x1]
    return _median(slopes) if slopes else 0.0


def kendall_tau(points: Sequence[tuple[float, float]]) -> float:
    """Kendall's tau-a between x and y: (concordant - discordant pairs) / all pairs; 0.0 with < 2 points."""
    n = len(points)
    if n < 2:
        return 0.0
    score = 0
    for i, (x1, y1) in enumerate(points):
        for x2, y2 in points[i + 1:]:
            score += _sign((x2 - x1) * (y2 - y1))
    return score / (n * (n - 1) / 2)


# --------------------------------------------------------------------------- the controller's answer


def give_up_reason(diag: PeakDiagnosis, attempt: int, job_id: str | None) -> str:
    """Why the controller gives up on a leak (no retry: a smaller batch or more memory only delays it)."""
    return (f"attempt {attempt} (job {job_id}) ran out of memory with a leak: {diag.reason}. "
            f"Not retried: a leak is fixed in the code, not by a smaller batch or more memory. {diag.remedies[0]}.")


def plan_for_ladder(plan, diag: PeakDiagnosis | None):
    """The plan the ladder sizes: for a long batch, ``plan`` with the long batch's length as its ``seq_len`` (the
    failure happened at that length, so the memory model must see it); else ``plan`` itself."""
    if diag is None or diag.case != LONG_BATCH:
        return plan
    return plan.replace(seq_len=max(plan.seq_len, int(diag.numbers["seq_len"])))


def long_batch_host_mib(diag: PeakDiagnosis, ranks_per_node: int) -> float | None:
    """Host memory (MiB per node, before the margin) a long batch needs, from the step series: the usual steps'
    peak RSS scaled by the length ratio (long / longest completed). Everything in the peak is taken to grow with
    the length, so the static part (weights, optimizer state) is over-counted, which a sizing can afford; attention
    that grows faster than the length is left to the margin. None when the series is not host memory (a GPU's
    ``max_memory_allocated``: the ladder's GPU moves size that) or lacks the numbers."""
    n = diag.numbers
    if diag.case != LONG_BATCH or diag.measure != "rss" or not n.get("usual_peak_mib") or not n.get("longest_done"):
        return None
    return float(n["usual_peak_mib"]) * n["seq_len"] / n["longest_done"] * max(1, ranks_per_node)


# --------------------------------------------------------------------------- the data's longest sequence


def parse_length_hist(text: str, name: str = "the histogram") -> dict[int, int]:
    """A length histogram: JSON ``{"length": count, ...}`` or CSV lines ``length,count`` (an optional
    ``length,count`` header; ``#`` comments and blank lines skipped). Lengths and counts are positive decimal
    integers (counts may be 0). Raises ConfigError with one line naming ``name`` and what is wrong."""
    stripped = text.strip()
    if not stripped:
        raise ConfigError(f"{name} is empty")
    pairs: list[tuple[str, Any, str]] = []
    if stripped[0] in "{[":
        try:
            data = json.loads(stripped)
        except ValueError as exc:
            raise ConfigError(f"{name} is not valid JSON: {exc}") from None
        except RecursionError:
            raise ConfigError(f"{name} is not valid JSON: nested too deeply") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{name}: expected a JSON object {{length: count}}")
        pairs = [(k, v, f"key {k!r}") for k, v in data.items()]
    else:
        for n, line in enumerate(stripped.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            cells = [c.strip() for c in line.split(",")]
            if len(cells) != 2:
                raise ConfigError(f"{name} line {n}: expected 'length,count', got {line[:80]!r}")
            if n == 1 and cells[0].lower() in ("length", "len", "seq_len") and not cells[0].isdigit():
                continue
            pairs.append((cells[0], cells[1], f"line {n}"))
    out: dict[int, int] = {}
    for length, count, where in pairs:
        ln = _strict_int(length)
        ct = _strict_int(count)
        if ln is None or ln < 1:
            raise ConfigError(f"{name} {where}: the length must be a positive integer, got {str(length)[:40]!r}")
        if ct is None or ct < 0:
            raise ConfigError(f"{name} {where}: the count must be a non-negative integer, got {str(count)[:40]!r}")
        if ln in out:
            raise ConfigError(f"{name} {where}: length {ln} is given twice")
        out[ln] = ct
    if not any(out.values()):
        raise ConfigError(f"{name} has no length with a count above 0")
    return out


def longest_sequence(max_seq_len: int | None, hist: Mapping[int, int] | None) -> int | None:
    """The longest sequence the data holds: ``max_seq_len``, or the largest length with a count in ``hist``
    (the larger of the two when both are given); None when neither is."""
    found = [max_seq_len] if max_seq_len else []
    if hist:
        found.append(max(n for n, c in hist.items() if c > 0))
    return max(found) if found else None


def sized_for_longest(seq_len: int, longest: int | None, source: str) -> dict[str, Any] | None:
    """What sizing a plan of ``seq_len`` for the data's ``longest`` sequence means, for --json and the text:
    {seq_len (the plan's), longest, sized_seq_len, source, note}; None when there is no longest."""
    if longest is None:
        return None
    sized = max(seq_len, longest)
    if longest > seq_len:
        note = (f"sized for the longest sequence: {longest} tokens ({source}) instead of the plan's seq_len "
                f"{seq_len}, so the longest batch fits")
    else:
        note = f"the longest sequence, {longest} tokens ({source}), is within the plan's seq_len {seq_len}"
    return {"seq_len": seq_len, "longest": longest, "sized_seq_len": sized, "source": source, "note": note}


# --------------------------------------------------------------------------- small helpers


def _entry(e: Any) -> bool:
    return (isinstance(e, (list, tuple)) and len(e) == 3 and _int(e[0]) is not None
            and (e[2] is None or (_num(e[2]) and math.isfinite(e[2]))))


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _strict_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 18:  # within int64
        return int(value)
    return None


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)
