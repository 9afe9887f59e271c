"""Why did a job die? A Verdict from its scheduler record and the tail of its logs.

``classify(record, text)`` is pure: it reads a scheduler record (state, exit code, signal; may be
None) and the end of the job's logs (all ranks concatenated) and returns a ``Verdict`` whose
``kind`` is exactly one of ``KINDS``. It knows nothing of what to do about it (that is the ladder).
``classify_file`` and ``classify_paths`` read log tails with ``toolkit.logtail`` first.

Lines and ranks
    Lines are split on ``\\n`` (a trailing ``\\r`` is dropped) and numbered from 1. Launcher prefixes
    are stripped before matching, repeatedly: ``[rank3]:`` (torch), ``[1,3]<stderr>:`` (Open MPI
    ``--tag-output``), ``[default3]:`` (torchrun ``--tee``; a local rank), ``3: `` (``srun --label``).
    The rank is the most specific prefix (``[rankN]`` > MPI tag > ``[defaultN]`` > srun label), else
    ``rank N`` / ``rank : N`` written on the line (or a torchrun summary's ``rank : N`` just above),
    else ``task N`` of an srun message; an OOM line without any takes the rank of the same failure
    reported on a ranked line within ``RANK_WINDOW`` lines after it (NCCL's WARN lines have none).
    Evidence lines are verbatim (prefix included) with their line numbers; at most ``MAX_EVIDENCE``.

Signatures, by kind (all sizes converted to MiB; see ``parse_size_to_mib``)
    gpu_oom*        ``CUDA out of memory`` (or HIP) after an exception name, or followed by
                    ``. Tried to allocate``; a sentence merely mentioning the words is not an event.
                    PyTorch >= 2.1: ``Tried to allocate X. GPU N has a total capacity of Y of which Z is
                    free. [Process P has M memory in use.] Including non-PyTorch memory, this process has
                    W memory in use. Of the allocated memory A is allocated by PyTorch, [with P allocated
                    in private pools,] and R is reserved by PyTorch but unallocated.`` (2.1.0 spelt
                    "capacty"). PyTorch <= 2.0: ``Tried to allocate X (GPU N; Y total capacity; A already
                    allocated; Z free; R reserved in total by PyTorch)`` (<= 1.3: ``R cached``).
                    The message may continue on the next lines of the same rank.
    gpu_oom_other_process
                    other processes hold ``other >= OTHER_PROCESS_SHARE`` (10 %) of the total capacity
                    AND ``other + free >= tried``: a foreign process holds a real share of the card and
                    without it the request would have fit, so no memory move of ours is the answer.
                    "Process P has M" lines are other processes when the message also has "this process
                    has W". Without that clause (pid namespaces, containers) this process is the
                    smallest listed one holding at least PyTorch's reserved memory (A + R), since a
                    process holds at least what its allocator reserved; with no A and R stated, the
                    largest one. ``other_process_mib`` is set when other processes hold anything.
    gpu_oom_fragmentation
                    idle reserved memory ``R`` (>= 2.1: reserved but unallocated; <= 2.0: reserved in
                    total - already allocated) is ``R >= tried`` AND ``R >= FRAGMENTATION_SHARE`` (5 %)
                    of the total capacity. Before raising, the caching allocator has already released
                    its unsplit cached blocks and retried, so idle reserved memory that could hold the
                    request is held in split blocks: fragmentation. The 5 % floor keeps a nearly full
                    card with a few hundred MiB of slack a plain gpu_oom: defragmenting it would gain
                    too little to fit the next step. (A missed fragmentation still gets memory moves.)
                    Precedence: other_process > fragmentation > gpu_oom.
    gpu_driver_oom  ``CUDA error: out of memory``, ``CUDA driver error: out of memory``,
                    ``CUBLAS_STATUS_ALLOC_FAILED``, ``CUDNN_STATUS_ALLOC_FAILED``,
                    ``cudaErrorMemoryAllocation``, ``CUDA_ERROR_OUT_OF_MEMORY``; and
                    ``CUDNN_STATUS_NOT_SUPPORTED``, ``CUDNN_STATUS_INTERNAL_ERROR``,
                    ``CUBLAS_STATUS_NOT_INITIALIZED`` only with memory pressure (an "out of memory",
                    "OOM", "ALLOC_FAILED", "failed to allocate"... line) within ``PRESSURE_WINDOW`` (20)
                    lines. Alone, ``CUDNN_STATUS_NOT_SUPPORTED`` is not_oom (an unsupported input) and the
                    other two are unknown (they can hide an OOM, but nothing shows it).
    nccl_oom        ``Cuda failure 'out of memory'`` (NCCL WARN or "Last error:"), ``Failed to CUDA
                    calloc``, ``failed to extend /dev/shm/nccl-*``, ``Error while creating shared memory
                    segment /dev/shm/nccl-*`` (even after a "No space left on device": /dev/shm is memory);
                    a following ``DistBackendError`` line joins the evidence. ``gpu`` is the CUDA device
                    NCCL prints as ``host:pid:tid [N] ... NCCL WARN``.
    host_oom        ``Detected N oom-kill event(s)`` / ``oom_kill event`` (Slurm cgroup, old and
                    >= 23.02), ``srun: error: node: task N: Out Of Memory``, ``exceeded memory limit ...
                    being killed``; or the record: state ``OUT_OF_MEMORY`` or exit code ``0:125``.
    cpu_alloc_oom   ``DefaultCPUAllocator: can't allocate memory`` / ``not enough memory`` (``you tried
                    to allocate N bytes``), numpy ``Unable to allocate X for an array``, ``MemoryError``.
    SIGKILL         launcher ``exits with return code = -9``, torchrun ``exitcode: -9`` / ``Signal 9
                    (SIGKILL) received``, ``<Signals.SIGKILL: 9>``, exit code/status 137, a bare
                    ``Killed`` line (also bash's ``line N: PID Killed``, srun's ``task N: Killed``, a
                    DataLoader worker "killed by signal: Killed"); record signal 9 or exit 137 / -9.
                    SIGKILL is host_oom only when confirmed (a cgroup event, OUT_OF_MEMORY or 0:125);
                    alone it is ``unknown``: "killed by SIGKILL, probably host memory; confirm with
                    sacct". The kernel OOM killer, an admin or a node health check all send SIGKILL,
                    and a memory move for a non-memory kill wastes an attempt.
    not_oom         device faults (illegal memory access, device-side assert, misaligned address,
                    unspecified launch failure, uncorrectable ECC error); ``DUE TO TIME LIMIT`` (time
                    limit), ``DUE TO PREEMPTION``, ``DUE TO NODE FAIL``, ``*** JOB/STEP .. CANCELLED AT``
                    (cancelled), NCCL watchdog timeout, ``No space left on device`` (disk full), disk
                    quota, ImportError/ModuleNotFoundError (import error), ``command not found``; record
                    states TIMEOUT, CANCELLED, PREEMPTED, NODE_FAIL, BOOT_FAIL, DEADLINE, COMPLETED
                    ("completed"); any other Python exception line (``pkg.NameError: ...``) except the
                    wrappers that only report a failure elsewhere (ChildFailedError, CalledProcessError,
                    DistBackendError, DistNetworkError, DistStoreError, SignalException, SystemExit).

Precedence (first rule that applies). An OOM is a cause, not a consequence: after one rank runs out
of memory the others hang into NCCL timeouts, the time limit or a cancellation, and the launcher
kills the rest; none of these causes an OOM. So:
    1. An OOM signature in the text -> the first one in the log decides kind, numbers, gpu and rank
       (even when the record says TIMEOUT, CANCELLED or COMPLETED: the log decides) -- unless a
       device fault comes before it (a broken CUDA context makes later allocation errors
       meaningless), then not_oom.
    2. Record OUT_OF_MEMORY or exit 0:125 -> host_oom (SIGKILL lines join the evidence).
    3. Record COMPLETED -> not_oom, "completed".
    4. A device fault in the text -> not_oom.
    5. The first in the log of: other not-OOM signatures -> not_oom; SIGKILL -> not_oom when the
       record says the scheduler ended the job (TIMEOUT, CANCELLED, ...), else unknown; an
       ambiguous cuDNN/cuBLAS error -> unknown.
    6. Record state TIMEOUT, CANCELLED, PREEMPTED, NODE_FAIL, BOOT_FAIL, DEADLINE -> not_oom.
    7. Record SIGKILL -> unknown ("killed by SIGKILL ...").
    8. The first non-wrapper Python exception line -> not_oom naming it.
    9. Otherwise unknown.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from .logtail import DEFAULT_MAX_BYTES, Tail, read_tail

OOM_KINDS = (
    "gpu_oom",
    "gpu_oom_fragmentation",
    "gpu_oom_other_process",
    "gpu_driver_oom",
    "nccl_oom",
    "host_oom",
    "cpu_alloc_oom",
)
KINDS = OOM_KINDS + ("not_oom", "unknown")

FRAGMENTATION_SHARE = 0.05
"""Idle reserved memory must reach this share of the GPU's capacity to call an OOM fragmentation."""
OTHER_PROCESS_SHARE = 0.10
"""Other processes must hold this share of the GPU's capacity to blame them for an OOM."""
CAPACITY_UNKNOWN_FLOOR_MIB = 1024.0
"""Stands in for a share of the capacity when a message does not state the capacity (MiB)."""
MAX_EVIDENCE = 10
PRESSURE_WINDOW = 20
"""Lines either side of a cuDNN/cuBLAS error searched for signs of memory pressure."""
RANK_WINDOW = 50
"""Lines after a rank-less OOM line searched for the same failure on a rank-prefixed line."""

_SIGKILL_REASON = "killed by SIGKILL, probably host memory; confirm with sacct"


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class JobRecord:
    """What the scheduler says about a job (any object or Mapping with these names will do)."""

    state: str | None = None
    """Slurm state: FAILED, OUT_OF_MEMORY, TIMEOUT, CANCELLED, COMPLETED... (truncated ``+`` forms accepted)."""
    exit_code: int | None = None
    """Exit code (the part before ':' of sacct's ExitCode; a "code:signal" string is also accepted)."""
    signal: int | None = None
    """Signal (the part after ':' of sacct's ExitCode; 125 with exit code 0 means a cgroup OOM)."""


@dataclass(frozen=True)
class Verdict:
    """Why an attempt ended."""

    kind: str
    """One of ``KINDS``."""
    numbers: dict = field(default_factory=dict)
    """MiB floats the message states: tried_to_allocate_mib, total_capacity_mib, free_mib,
    process_in_use_mib, allocated_by_pytorch_mib, reserved_unallocated_mib, already_allocated_mib,
    reserved_total_mib, other_process_mib."""
    gpu: int | None = None
    """GPU (CUDA device) index the message names."""
    rank: int | None = None
    """Rank of the decisive line (from a launcher prefix or the text)."""
    evidence: tuple = ()
    """(line_number, line) pairs, 1-based, verbatim, in line order."""
    reason: str = ""
    """One sentence for a person."""
    ranks: tuple = ()
    """When two or more ranks show a failure: the first failure of each rank, in log order, as dicts
    ``{rank, kind, what, line}`` (kind: the verdict kind that line alone would give; line: 1-based;
    ``file`` too when several logs were read). The first entry is the rank that failed first."""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown verdict kind {self.kind!r}; valid: {', '.join(KINDS)}")

    @property
    def is_oom(self) -> bool:
        """True for the seven out-of-memory kinds."""
        return self.kind in OOM_KINDS

    def to_dict(self) -> dict:
        """JSON-ready: kind, numbers, gpu, rank, evidence [{line, text}], reason."""
        return {
            "kind": self.kind,
            "numbers": dict(self.numbers),
            "gpu": self.gpu,
            "rank": self.rank,
            "evidence": [{"line": n, "text": s} for n, s in self.evidence],
            "reason": self.reason,
            "ranks": [dict(r) for r in self.ranks],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Verdict":
        """The inverse of ``to_dict`` (a verdict read back from the ledger)."""
        return cls(kind=data["kind"], numbers=dict(data.get("numbers") or {}), gpu=data.get("gpu"),
                   rank=data.get("rank"), reason=data.get("reason", ""),
                   evidence=tuple((e["line"], e["text"]) for e in data.get("evidence") or ()),
                   ranks=tuple(dict(r) for r in data.get("ranks") or ()))


# --------------------------------------------------------------------------- sizes

_UNIT_MIB = {"": 1 / 2**20, "K": 1 / 1024, "M": 1.0, "G": 1024.0, "T": 1024.0**2}
_SIZE = r"\d+(?:\.\d+)?\s*(?i:[KMGT]i?B|[KMGT]|bytes?|B)\b"
_SIZE_PARTS = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?i:([KMGT])i?B?|bytes?|B)\s*\Z")


def parse_size_to_mib(text: str) -> float:
    """``"1.50 GiB"`` -> 1536.0 MiB.

    Units: bytes/byte/B, KiB/KB/K, MiB/MB/M, GiB/GB/G, TiB/TB/T, any case, with or without
    decimals. KB/MB/GB are read as binary units like their -iB forms: PyTorch prints only -iB
    units, and the HPC tools that print "GB" (Slurm, DeepSpeed) mean 1024-based sizes.
    Raises ValueError for anything else.
    """
    m = _SIZE_PARTS.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r}")
    return float(m.group(1)) * _UNIT_MIB[(m.group(2) or "").upper()]


def _fmt_mib(mib: float) -> str:
    """MiB as PyTorch would print it (GiB from 1 GiB up)."""
    return f"{mib / 1024:.2f} GiB" if mib >= 1024 else f"{mib:.2f} MiB"


# --------------------------------------------------------------------------- record


_STATES = (
    "COMPLETED", "FAILED", "OUT_OF_MEMORY", "TIMEOUT", "CANCELLED", "PREEMPTED", "NODE_FAIL",
    "BOOT_FAIL", "DEADLINE", "RUNNING", "PENDING", "COMPLETING", "REQUEUED", "SUSPENDED", "UNKNOWN",
)
_STATE_REASONS = {
    "TIMEOUT": "time limit",
    "CANCELLED": "cancelled",
    "PREEMPTED": "preempted",
    "NODE_FAIL": "node failure",
    "BOOT_FAIL": "node boot failure",
    "DEADLINE": "deadline reached",
}


def _record(record: Any) -> JobRecord:
    """Normalise a record (None, JobRecord, any object, Mapping) to a JobRecord."""
    if record is None:
        return JobRecord()
    if isinstance(record, Mapping):
        get = record.get
    else:
        def get(name, default=None):
            return getattr(record, name, default)
    exit_code, signal = get("exit_code"), get("signal")
    if isinstance(exit_code, str) and ":" in exit_code:
        exit_code, sig = exit_code.split(":", 1)
        signal = sig if signal is None else signal
    return JobRecord(_state(get("state")), _int(exit_code), _int(signal))


def _state(state: Any) -> str | None:
    """"CANCELLED by 0" -> CANCELLED; "OUT_OF_ME+" -> OUT_OF_MEMORY (sacct truncates)."""
    if not state:
        return None
    word = str(state).strip().upper().split()[0] if str(state).strip() else ""
    if word.endswith("+"):
        word = next((s for s in _STATES if s.startswith(word[:-1])), word[:-1])
    return word or None


def _int(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _record_host_oom(rec: JobRecord) -> bool:
    return rec.state == "OUT_OF_MEMORY" or (rec.exit_code == 0 and rec.signal == 125)


def _record_sigkill(rec: JobRecord) -> bool:
    return rec.signal == 9 or rec.exit_code in (137, -9)


def _describe_record(rec: JobRecord) -> str:
    parts = [rec.state] if rec.state else []
    if rec.exit_code is not None or rec.signal is not None:
        parts.append(f"exit code {rec.exit_code if rec.exit_code is not None else 0}:{rec.signal or 0}")
    return ", ".join(parts)


# --------------------------------------------------------------------------- lines

_PREFIXES = (  # (priority, pattern); lower priority number = more specific rank
    (0, re.compile(r"\[rank(\d+)\]:\s?")),
    (1, re.compile(r"\[\d+,(\d+)\]<(?:stdout|stderr|stddiag)>:\s?")),
    (2, re.compile(r"\[default(\d+)\]:\s?")),
    (3, re.compile(r"\s*(\d+): ")),
)
_INLINE_RANK = re.compile(r"\b(?:rank|Rank|RANK)\s*[:=]?\s*(\d+)\b")
_SUMMARY_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_TASK = re.compile(r"\btasks? (\d+)")


def split_prefix(line: str) -> tuple[int | None, str]:
    """Strip launcher prefixes from a line: ``"[rank3]: x"`` -> ``(3, "x")``; ``(None, line)`` if none."""
    best: tuple[int, int] | None = None
    pos = 0
    for _ in range(4):
        for prio, pattern in _PREFIXES:
            m = pattern.match(line, pos)
            if m:
                if best is None or prio < best[0]:
                    best = (prio, int(m.group(1)))
                pos = m.end()
                break
        else:
            break
    return (best[1] if best else None), line[pos:]


class _Log:
    """The lines of a text, with prefix splitting done once per line on demand."""

    def __init__(self, text: str):
        self.raw = [s[:-1] if s.endswith("\r") else s for s in text.split("\n")]
        self._split: dict[int, tuple[int | None, str]] = {}

    def __len__(self) -> int:
        return len(self.raw)

    def split(self, i: int) -> tuple[int | None, str]:
        if i not in self._split:
            self._split[i] = split_prefix(self.raw[i])
        return self._split[i]

    def rank(self, i: int) -> int | None:
        return self.split(i)[0]

    def body(self, i: int) -> str:
        return self.split(i)[1]


# --------------------------------------------------------------------------- signatures


@dataclass(frozen=True)
class _Event:
    """One recognised signature in the log."""

    index: int  # 0-based index of the decisive line
    group: str  # oom | fault | not_oom | sigkill | ambiguous | exception
    kind: str  # a Verdict kind for group "oom"; a short label otherwise
    rank: int | None = None
    gpu: int | None = None
    numbers: Mapping = field(default_factory=dict)
    lines: tuple = ()  # indices of all lines of this event
    detail: str = ""  # words for the reason


def _sig(*patterns: str) -> re.Pattern:
    return re.compile("|".join(f"(?:{p})" for p in patterns))


_GPU_OOM = _sig(
    r"(?:Error|Exception):\s*(?:CUDA|HIP) out of memory",  # an exception line
    r"(?:CUDA|HIP) out of memory\.\s*Tried to allocate",  # the message, logged without the exception name
)

# (group, kind or label, detail for the reason, pattern); the first match on a line wins.
_SIGNATURES = (
    ("oom", "nccl_oom", "NCCL could not allocate device memory",
     _sig(r"Cuda failure '?out of memory", r"Failed to CUDA calloc")),
    ("oom", "nccl_oom", "NCCL could not extend its shared memory in /dev/shm",
     _sig(r"failed to extend /dev/shm/nccl", r"Error while creating shared memory segment /dev/shm/nccl")),
    ("oom", "gpu_driver_oom", "", _sig(
        r"CUDA (?:driver )?error: out of memory", r"CUBLAS_STATUS_ALLOC_FAILED", r"CUDNN_STATUS_ALLOC_FAILED",
        r"cudaErrorMemoryAllocation", r"CUDA_ERROR_OUT_OF_MEMORY")),
    ("oom", "cpu_alloc_oom", "", _sig(
        r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory)", r"Unable to allocate .+ for an array",
        r"^(?:[\w.]+\.)?MemoryError\b")),
    ("oom", "host_oom", "the Slurm cgroup out-of-memory handler killed a task",
     _sig(r"Detected \d+ oom[-_ ]kill event")),
    ("oom", "host_oom", "srun reported a task out of memory", _sig(r"\btasks? [\d,\-]+: Out Of Memory")),
    ("oom", "host_oom", "Slurm killed the job for exceeding its memory limit",
     _sig(r"exceeded memory limit.*being killed", r"Exceeded job memory limit\s*$")),
    ("fault", "illegal memory access", "", _sig(r"an illegal memory access was encountered")),
    ("fault", "device-side assert", "", _sig(r"device-side assert(?:ion)? triggered")),
    ("fault", "misaligned address", "", _sig(r"CUDA error: misaligned address")),
    ("fault", "unspecified launch failure", "", _sig(r"unspecified launch failure")),
    ("fault", "uncorrectable ECC error", "", _sig(r"uncorrectable ECC error")),
    ("not_oom", "time limit", "", _sig(r"DUE TO TIME LIMIT")),
    ("not_oom", "preempted", "", _sig(r"DUE TO PREEMPTION")),
    ("not_oom", "node failure", "", _sig(r"DUE TO NODE FAIL")),
    ("not_oom", "cancelled", "", _sig(r"\*\*\* (?:JOB|STEP) \S+ ON \S+ CANCELLED AT")),
    ("not_oom", "NCCL watchdog timeout", "",
     _sig(r"Watchdog caught collective operation timeout", r"Timeout at NCCL work")),
    ("not_oom", "disk full", "", _sig(r"No space left on device", r"\[Errno 28\]")),
    ("not_oom", "disk quota exceeded", "", _sig(r"Disk quota exceeded", r"\[Errno 122\]")),
    ("not_oom", "import error", "", _sig(r"^(?:[\w.]+\.)?(?:ImportError|ModuleNotFoundError)\b")),
    ("not_oom", "command not found", "",
     _sig(r"command not found\s*$", r"execve\(\): .*No such file or directory")),
    ("sigkill", "SIGKILL", "", _sig(
        r"exits with return code = -9\b", r"exitcode\s*:\s*-9\b", r"Signal 9 \(SIGKILL\)", r"Signals\.SIGKILL",
        r"\bexit (?:code|status)\s*[=:]?\s*137\b", r"^\s*Killed\s*$", r"line \d+:\s*\d+ Killed\b",
        r"\btasks? [\d,\-]+: Killed\b", r"killed by signal: Killed")),
    ("disguised", "CUDNN_STATUS_NOT_SUPPORTED", "", _sig(r"CUDNN_STATUS_NOT_SUPPORTED")),
    ("disguised", "CUDNN_STATUS_INTERNAL_ERROR", "", _sig(r"CUDNN_STATUS_INTERNAL_ERROR")),
    ("disguised", "CUBLAS_STATUS_NOT_INITIALIZED", "", _sig(r"CUBLAS_STATUS_NOT_INITIALIZED")),
)
# Words one of which a line must contain before the (slow, many-branched) SIGKILL pattern runs.
_SIGKILL_WORDS = ("-9", "137", "SIGKILL", "Killed")
_EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Z]\w*(?:Error|Exception|Interrupt|Exit|Failure))(?::\s*(.*))?$")
_WRAPPERS = {
    "ChildFailedError", "CalledProcessError", "DistBackendError", "DistNetworkError", "DistStoreError",
    "SignalException", "SystemExit",
}
_PRESSURE = re.compile(
    r"out of memory|\bOOM\b|ALLOC_FAILED|cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY|"
    r"memory allocation failed|insufficient memory|failed to allocate",
    re.IGNORECASE,
)
# Cheap test run on every line; a line that fails it cannot match any signature above.
_PREFILTER = re.compile(
    r"out of memory|Out Of Memory|oom|ALLOC_FAILED|MemoryAllocation|OUT_OF_MEMORY|MemoryError|"
    r"calloc|/dev/shm|Unable to allocate|DefaultCPUAllocator|memory limit|illegal memory|device-side|"
    r"misaligned|launch failure|ECC|DUE TO|CANCELLED|Watchdog|Timeout at NCCL|No space|Errno|quota|"
    r"not found|execve|-9|137|SIGKILL|Killed|CUDNN_STATUS|CUBLAS_STATUS|Error|Exception|Interrupt|Exit|Failure"
)


def _scan(log: _Log) -> list[_Event]:
    """All signature events in line order."""
    events = []
    for i, raw in enumerate(log.raw):
        if _PREFILTER.search(raw):
            event = _line_event(log, i)
            if event is not None:
                events.append(event)
    return events


def _line_event(log: _Log, i: int) -> _Event | None:
    """The event line ``i`` shows, if any (one per line)."""
    rank, body = log.split(i)
    if _GPU_OOM.search(body):
        return _gpu_oom_event(log, i)
    for group, kind, detail, pattern in _SIGNATURES:
        if group == "sigkill" and not any(word in body for word in _SIGKILL_WORDS):
            continue
        m = pattern.search(body)
        if m:
            if group == "disguised":
                return _disguised_event(log, i, kind)
            return _simple_event(log, i, group, kind, detail or m.group(0).strip())
    m = _EXCEPTION.match(body)
    if m and m.group(1) not in _WRAPPERS:
        message = (m.group(2) or "").strip()
        detail = f"{m.group(1)}: {message[:120]}" if message else m.group(1)
        label = "interrupted" if m.group(1) == "KeyboardInterrupt" else detail
        return _Event(i, "exception", label, _rank(log, i), lines=(i,), detail=detail)
    return None


def _rank(log: _Log, i: int) -> int | None:
    """Rank of line ``i``: its prefix, else "rank N" on it, else a torchrun summary's "rank : N" above it."""
    rank, body = log.split(i)
    if rank is not None:
        return rank
    m = _INLINE_RANK.search(body)
    if m:
        return int(m.group(1))
    for j in range(i - 1, max(i - 4, -1), -1):
        m = _SUMMARY_RANK.match(log.body(j))
        if m:
            return int(m.group(1))
    return None


def _simple_event(log: _Log, i: int, group: str, kind: str, detail: str) -> _Event:
    body = log.body(i)
    rank = _rank(log, i)
    gpu = numbers = None
    lines = (i,)
    if kind == "host_oom" and rank is None:
        m = re.search(r"\btask (\d+): Out Of Memory", body)
        rank = int(m.group(1)) if m else None
    if kind == "nccl_oom":
        m = re.match(r"\S+:\d+:\d+ \[(\d+)\] .*NCCL WARN", body)  # host:pid:tid [cudaDev] file:line NCCL WARN
        gpu = int(m.group(1)) if m else None
        m = re.search(r"(?:calloc|to) (\d+) bytes", body)
        numbers = {"tried_to_allocate_mib": int(m.group(1)) / 2**20} if m else None
        lines += _following(log, i, "DistBackendError", 80)
    if kind == "cpu_alloc_oom":
        m = re.search(r"you tried to allocate (\d+) bytes", body)
        if m:
            numbers = {"tried_to_allocate_mib": int(m.group(1)) / 2**20}
        m = re.search(r"Unable to allocate (" + _SIZE + ")", body)
        if m:
            numbers = {"tried_to_allocate_mib": parse_size_to_mib(m.group(1))}
    return _Event(i, group, kind, rank, gpu, numbers or {}, lines, detail)


def _following(log: _Log, i: int, needle: str, window: int) -> tuple:
    """Index of the first line after ``i`` within ``window`` that contains ``needle``.

    Same rank as line ``i`` when that has one (NCCL's own lines carry no rank prefix).
    """
    rank = log.rank(i)
    for j in range(i + 1, min(i + 1 + window, len(log))):
        if needle in log.raw[j] and (rank is None or log.rank(j) == rank):
            return (j,)
    return ()


def _disguised_event(log: _Log, i: int, code: str) -> _Event:
    """cuDNN/cuBLAS errors: an OOM only with memory pressure nearby."""
    rank = _rank(log, i)
    lo, hi = max(0, i - PRESSURE_WINDOW), min(len(log), i + PRESSURE_WINDOW + 1)
    pressure = [j for j in range(lo, hi) if j != i and _PRESSURE.search(log.raw[j])]
    if pressure:
        near = min(pressure, key=lambda j: abs(j - i))
        detail = f"{code} next to memory pressure"
        return _Event(i, "oom", "gpu_driver_oom", rank, lines=tuple(sorted((i, near))), detail=detail)
    if code == "CUDNN_STATUS_NOT_SUPPORTED":
        return _Event(i, "not_oom", f"cuDNN error {code} (an unsupported input or configuration)", rank, lines=(i,))
    detail = f"{code} with no sign of memory pressure in the log; it can hide an out-of-memory"
    return _Event(i, "ambiguous", code, rank, lines=(i,), detail=detail)


# --------------------------------------------------------------------------- CUDA caching allocator

_OOM_CLAUSES = re.compile(
    r"Tried to allocate|total capaci?ty|is free|memory in use|allocated by PyTorch|reserved by PyTorch|"
    r"already allocated|reserved in total|allocated in private pools"
)
_OOM_END = re.compile(r"reserved by PyTorch but unallocated|reserved in total by PyTorch|cached\)")
_NEW = {
    "tried_to_allocate_mib": re.compile(r"Tried to allocate (" + _SIZE + ")"),
    "total_capacity_mib": re.compile(r"has a total capaci?ty of (" + _SIZE + ")"),
    "free_mib": re.compile(r"of which (" + _SIZE + r") is free"),
    "process_in_use_mib": re.compile(r"this process has (" + _SIZE + r") memory in use"),
    "allocated_by_pytorch_mib": re.compile(r"Of the allocated memory (" + _SIZE + r") is allocated by PyTorch"),
    "reserved_unallocated_mib": re.compile(r"(" + _SIZE + r") is reserved by PyTorch but unallocated"),
}
_NEW_GPU = re.compile(r"GPU (\d+) has a total capaci?ty")
_PROCESS = re.compile(r"Process (\d+) has (" + _SIZE + r") memory in use")
_OLD = re.compile(r"\(GPU (\d+); ([^)]*)\)")
_OLD_CLAUSES = (
    ("total_capacity_mib", "total capacity"),
    ("already_allocated_mib", "already allocated"),
    ("free_mib", "free"),
    ("reserved_total_mib", "reserved in total"),
    ("reserved_total_mib", "cached"),
)
_CLAUSE = re.compile(r"\s*(" + _SIZE + r")\s+(.*?)\s*$")


def _gpu_oom_event(log: _Log, i: int) -> _Event:
    """A caching-allocator OOM: parse its numbers, decide plain / fragmentation / other process."""
    lines = (i,) + _continuation(log, i)
    message = " ".join(log.body(j) for j in lines)
    numbers, gpu, processes, has_self = _oom_numbers(message)
    other = _other_process_mib(numbers, processes, has_self)
    if other > 0:
        numbers["other_process_mib"] = other
    kind = _gpu_kind(numbers)
    return _Event(i, "oom", kind, _rank(log, i), gpu, numbers, lines, "CUDA out of memory")


def _continuation(log: _Log, i: int) -> tuple:
    """Following lines of the same rank that carry the rest of a wrapped OOM message."""
    found: list[int] = []
    if _OOM_END.search(log.body(i)):
        return ()
    rank = log.rank(i)
    for j in range(i + 1, min(i + 8, len(log))):
        if log.rank(j) != rank:
            continue
        body = log.body(j)
        if not _OOM_CLAUSES.search(body) or _GPU_OOM.search(body):
            break
        found.append(j)
        if _OOM_END.search(body):
            break
    return tuple(found)


def _oom_numbers(message: str) -> tuple[dict, int | None, list, bool]:
    """(numbers in MiB, gpu, other "Process P" usages in MiB, whether "this process" was stated)."""
    numbers: dict[str, float] = {}
    gpu = None
    old = _OLD.search(message)
    if old:
        gpu = int(old.group(1))
        for clause in old.group(2).split(";"):
            m = _CLAUSE.match(clause)
            if m:
                name = next((n for n, label in _OLD_CLAUSES if m.group(2).startswith(label)), None)
                if name:
                    numbers[name] = parse_size_to_mib(m.group(1))
    m = _NEW_GPU.search(message)
    if m:
        gpu = int(m.group(1))
    for name, pattern in _NEW.items():
        m = pattern.search(message)
        if m and name not in numbers:
            numbers[name] = parse_size_to_mib(m.group(1))
    processes = [parse_size_to_mib(m.group(2)) for m in _PROCESS.finditer(message)]
    return numbers, gpu, processes, "process_in_use_mib" in numbers


def _other_process_mib(numbers: Mapping, processes: list, has_self: bool) -> float:
    """MiB held by processes other than this one (see the module docstring for the rule)."""
    if not processes:
        return 0.0
    if has_self:
        return sum(processes)
    allocated = numbers.get("allocated_by_pytorch_mib")
    unallocated = numbers.get("reserved_unallocated_mib")
    if allocated is not None and unallocated is not None:
        mine = [p for p in processes if p >= allocated + unallocated]
        return sum(processes) - min(mine) if mine else sum(processes)
    return sum(processes) - max(processes)


def _share_floor(numbers: Mapping, share: float) -> float:
    total = numbers.get("total_capacity_mib")
    return share * total if total else CAPACITY_UNKNOWN_FLOOR_MIB


def _gpu_kind(numbers: Mapping) -> str:
    """gpu_oom_other_process > gpu_oom_fragmentation > gpu_oom (thresholds in the module docstring)."""
    tried = numbers.get("tried_to_allocate_mib")
    if tried is None:
        return "gpu_oom"
    other = numbers.get("other_process_mib", 0.0)
    if other >= _share_floor(numbers, OTHER_PROCESS_SHARE) and other + numbers.get("free_mib", 0.0) >= tried:
        return "gpu_oom_other_process"
    idle = _idle_reserved_mib(numbers)
    if idle is not None and idle >= tried and idle >= _share_floor(numbers, FRAGMENTATION_SHARE):
        return "gpu_oom_fragmentation"
    return "gpu_oom"


def _idle_reserved_mib(numbers: Mapping) -> float | None:
    """Reserved but unallocated MiB (>= 2.1), or reserved in total - already allocated (<= 2.0)."""
    if "reserved_unallocated_mib" in numbers:
        return numbers["reserved_unallocated_mib"]
    if "reserved_total_mib" in numbers and "already_allocated_mib" in numbers:
        return numbers["reserved_total_mib"] - numbers["already_allocated_mib"]
    return None


# --------------------------------------------------------------------------- decision


def classify(record: Any, text: str) -> Verdict:
    """Classify a job from its scheduler record (or None) and the tail of its logs.

    ``record``: None, a ``JobRecord``, or any object/Mapping with ``state``, ``exit_code``,
    ``signal``. ``text``: the end of the logs of all ranks. Evidence line numbers are 1-based
    within ``text``. See the module docstring for the signatures and the precedence.
    """
    return _classify(record, text)[0]


def _classify(record: Any, text: str) -> tuple[Verdict, int | None]:
    """(verdict, 0-based index of the decisive line or None when the record decided)."""
    log = _Log(text)
    rec = _record(record)
    events = _lend_ranks(_scan(log), log)
    event, verdict = _decide(rec, events)
    return _finish(verdict, event, events, log), (event.index if event else None)


def _lend_ranks(events: list, log: _Log) -> list:
    """Give an OOM event without a rank the rank of its other lines, or of the next event of the
    same kind within ``RANK_WINDOW`` lines (NCCL's own WARN lines carry no rank prefix)."""
    lent = []
    for e in events:
        if e.group == "oom" and e.rank is None:
            ranks = [log.rank(j) for j in e.lines if log.rank(j) is not None]
            ranks += [
                o.rank for o in events
                if o.kind == e.kind and o.rank is not None and 0 < o.index - e.index <= RANK_WINDOW
            ]
            if ranks:
                e = replace(e, rank=ranks[0])
        lent.append(e)
    return lent


def _first(events: list, *groups: str) -> _Event | None:
    return next((e for e in events if e.group in groups), None)


def _decide(rec: JobRecord, events: list) -> tuple[_Event | None, Verdict]:
    """Apply the precedence rules; returns the decisive event (if any) and a verdict without evidence."""
    oom, fault = _first(events, "oom"), _first(events, "fault")
    if oom and not (fault and fault.index < oom.index):
        return oom, _oom_verdict(oom, rec)
    if _record_host_oom(rec):
        reason = f"Host memory ran out: the scheduler recorded {_describe_record(rec)}."
        return None, Verdict("host_oom", reason=reason)
    if rec.state == "COMPLETED":
        return None, Verdict("not_oom", reason="The job completed.")
    if fault:
        return fault, _not_oom(fault.kind, fault.rank)
    cause = _first(events, "not_oom", "sigkill", "ambiguous")
    if cause and cause.group == "not_oom":
        return cause, _not_oom(cause.kind, cause.rank)
    if cause and rec.state in _STATE_REASONS:
        return cause, _not_oom(_STATE_REASONS[rec.state], cause.rank, f"the scheduler recorded {rec.state}")
    if cause and cause.group == "sigkill":
        reason = f"A process was {_SIGKILL_REASON} (no cgroup out-of-memory event or OUT_OF_MEMORY state seen)."
        return cause, Verdict("unknown", rank=cause.rank, reason=reason)
    if cause:
        return cause, Verdict("unknown", rank=cause.rank, reason=f"{cause.detail}.")
    if rec.state in _STATE_REASONS:
        return None, _not_oom(_STATE_REASONS[rec.state], None, f"the scheduler recorded {rec.state}")
    if _record_sigkill(rec):
        return None, Verdict("unknown", reason=f"The job was {_SIGKILL_REASON} ({_describe_record(rec)}).")
    exc = _first(events, "exception")
    if exc:
        return exc, _not_oom(exc.kind, exc.rank)
    said = f" (the scheduler recorded {_describe_record(rec)})" if _describe_record(rec) else ""
    return None, Verdict("unknown", reason=f"No recognisable failure signature in the log{said}.")


def _not_oom(label: str, rank: int | None, note: str = "") -> Verdict:
    where = f" on rank {rank}" if rank is not None else ""
    tail = f" ({note})" if note else ""
    return Verdict("not_oom", rank=rank, reason=f"Not an out-of-memory failure{where}: {label}{tail}.")


def _oom_verdict(event: _Event, rec: JobRecord) -> Verdict:
    numbers = dict(event.numbers)
    where = (f" on GPU {event.gpu}" if event.gpu is not None else "") + (
        f" (rank {event.rank})" if event.rank is not None else ""
    )
    reason = _OOM_REASONS[event.kind](event, numbers, where)
    if rec.state and rec.state not in ("FAILED", "OUT_OF_MEMORY"):
        reason = reason[:-1] + f", although the scheduler recorded {rec.state}."
    return Verdict(event.kind, numbers, event.gpu, event.rank, reason=reason)


def _gpu_oom_reason(event: _Event, n: Mapping, where: str) -> str:
    parts = []
    if "tried_to_allocate_mib" in n:
        parts.append(f"tried to allocate {_fmt_mib(n['tried_to_allocate_mib'])}")
    if "free_mib" in n:
        parts.append(f"with {_fmt_mib(n['free_mib'])} free")
    if "total_capacity_mib" in n:
        parts.append(f"of {_fmt_mib(n['total_capacity_mib'])}")
    if n.get("other_process_mib"):
        parts.append(f"(other processes hold {_fmt_mib(n['other_process_mib'])})")
    said = ": " + " ".join(parts) if parts else ""
    return f"CUDA out of memory{where}{said}."


def _fragmentation_reason(event: _Event, n: Mapping, where: str) -> str:
    idle = _idle_reserved_mib(n)
    return (
        f"CUDA out of memory from fragmentation{where}: {_fmt_mib(idle)} reserved by PyTorch but unallocated "
        f"could not serve a {_fmt_mib(n['tried_to_allocate_mib'])} request."
    )


def _other_process_reason(event: _Event, n: Mapping, where: str) -> str:
    total = n.get("total_capacity_mib")
    of = f" of {_fmt_mib(total)}" if total else ""
    return (
        f"CUDA out of memory{where} because other processes hold {_fmt_mib(n['other_process_mib'])}{of}; "
        f"without them the {_fmt_mib(n['tried_to_allocate_mib'])} request would have fit."
    )


def _cpu_reason(event: _Event, n: Mapping, where: str) -> str:
    asked = f" {_fmt_mib(n['tried_to_allocate_mib'])}" if "tried_to_allocate_mib" in n else ""
    return (
        f"Host memory ran out inside the process{where}: an allocation of{asked or ' memory'} failed "
        f"({event.detail})."
    )


_OOM_REASONS = {
    "gpu_oom": _gpu_oom_reason,
    "gpu_oom_fragmentation": _fragmentation_reason,
    "gpu_oom_other_process": _other_process_reason,
    "gpu_driver_oom": lambda e, n, w: f"GPU memory ran out outside PyTorch's caching allocator{w}: {e.detail}.",
    "nccl_oom": lambda e, n, w: f"{e.detail}{w}.",
    "host_oom": lambda e, n, w: f"Host memory ran out{w}: {e.detail}.",
    "cpu_alloc_oom": _cpu_reason,
}


def _finish(verdict: Verdict, event: _Event | None, events: list, log: _Log) -> Verdict:
    """Attach evidence: the decisive lines first, then supporting events, at most MAX_EVIDENCE."""
    wanted: list[int] = list(event.lines) if event else []
    for e in events:
        if e is event:
            continue
        same = event is not None and e.group == event.group and e.kind == event.kind
        kill = verdict.kind in ("host_oom", "unknown") and e.group == "sigkill"
        if same or kill:
            wanted.extend(e.lines)
    chosen = sorted(list(dict.fromkeys(wanted))[:MAX_EVIDENCE])  # dedupe, keep the most important
    evidence = tuple((j + 1, log.raw[j]) for j in chosen)
    return replace(verdict, evidence=evidence, ranks=_rank_failures(events))


_RANK_KIND = {"fault": "not_oom", "not_oom": "not_oom", "exception": "not_oom", "sigkill": "unknown",
              "ambiguous": "unknown"}


def _rank_failures(events: list) -> tuple:
    """The first failure event of each rank, in log order; () unless two or more ranks show one."""
    first: dict[int, _Event] = {}
    for e in events:
        if e.rank is not None and e.rank not in first:
            first[e.rank] = e
    if len(first) < 2:
        return ()
    return tuple({"rank": e.rank, "kind": e.kind if e.group == "oom" else _RANK_KIND[e.group],
                  "what": e.detail or e.kind, "line": e.index + 1}
                 for e in sorted(first.values(), key=lambda e: e.index))


# --------------------------------------------------------------------------- files


def classify_file(path: str | os.PathLike, record: Any = None, max_bytes: int = DEFAULT_MAX_BYTES) -> Verdict:
    """Classify from the last ``max_bytes`` of one log file (plain or gzip).

    Evidence line numbers are line numbers of the file when the tail's first line is known (the
    whole file was read, or any gzip); when the head of a large plain file was skipped they count
    from the start of the tail, and the reason says so. Raises ``logtail.LogError`` when the file
    cannot be read.
    """
    return classify_paths([path], record, max_bytes)


def classify_paths(
    paths: Iterable[str | os.PathLike], record: Any = None, max_bytes: int = DEFAULT_MAX_BYTES,
    number_lines: bool = False,
) -> Verdict:
    """Classify from several log files (e.g. one per rank), read up to ``max_bytes`` each.

    The tails are concatenated in the order given ("first in the log" means first in that order)
    and classified as one text. Evidence keeps the lines of the file holding the decisive line
    (numbered as in ``classify_file``; ``number_lines`` counts the lines of a skipped head so the
    numbers are the file's own), and with more than one file the reason names that file.
    """
    paths = [os.fspath(p) for p in paths]
    tails = [read_tail(p, max_bytes, number_lines) for p in paths]
    origin: list[tuple[int, int]] = []  # combined line index -> (file index, 0-based line in tail)
    chunks = []
    for k, tail in enumerate(tails):
        lines = tail.text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        origin.extend((k, j) for j in range(len(lines)))
        chunks.extend(lines)
    verdict, decisive = _classify(record, "\n".join(chunks))
    if verdict.ranks:
        verdict = replace(verdict, ranks=tuple(_file_line(r, origin, tails, paths) for r in verdict.ranks))
    if not verdict.evidence:
        return _annotate(verdict, tails, paths, None, max_bytes, len(paths) > 1)
    k = origin[decisive][0] if decisive is not None else origin[verdict.evidence[0][0] - 1][0]
    offset = (tails[k].first_line or 1) - 1
    evidence = tuple((origin[n - 1][1] + 1 + offset, s) for n, s in verdict.evidence if origin[n - 1][0] == k)
    verdict = replace(verdict, evidence=evidence)
    return _annotate(verdict, tails, paths, k, max_bytes, len(paths) > 1)


def _file_line(entry: Mapping, origin: list, tails: list[Tail], paths: list[str]) -> dict:
    """A rank entry's line number in its own file (and the file, when several were read)."""
    k, j = origin[entry["line"] - 1]
    out = {**entry, "line": j + (tails[k].first_line or 1)}
    if len(paths) > 1:
        out["file"] = paths[k]
    return out


def _annotate(
    verdict: Verdict, tails: list[Tail], paths: list[str], k: int | None, max_bytes: int, name: bool
) -> Verdict:
    """Add to the reason what the reader must know about the files read."""
    notes = []
    if k is not None and name:
        notes.append(f"in {paths[k]}")
    if k is not None and verdict.evidence and tails[k].first_line is None:
        notes.append(f"line numbers count from the start of the last {_fmt_mib(max_bytes / 2**20)} of the log")
    damaged = [p for p, t in zip(paths, tails) if t.damaged]
    if damaged:
        notes.append(f"damaged gzip read as far as possible: {', '.join(damaged)}")
    if not notes:
        return verdict
    reason = verdict.reason.rstrip(".") + " (" + "; ".join(notes) + ")."
    return replace(verdict, reason=reason)
