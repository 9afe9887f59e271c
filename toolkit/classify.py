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
    gpu_oom*        ``CUDA out of memory`` (or HIP, XPU, ``MPS backend``) after an exception name, or followed by
                    ``. Tried to allocate``; a sentence merely mentioning the words is not an event.
                    PyTorch >= 2.1: ``Tried to allocate X. GPU N has a total capacity of Y of which Z is
                    free. [Process P has M memory in use.] Including non-PyTorch memory, this process has
                    W memory in use. Of the allocated memory A is allocated by PyTorch, [with P allocated
                    in private pools,] and R is reserved by PyTorch but unallocated.`` (2.1.0 spelt
                    "capacty"). PyTorch <= 2.0: ``Tried to allocate X (GPU N; Y total capacity; A already
                    allocated; Z free; R reserved in total by PyTorch)`` (<= 1.3: ``R cached``).
                    The message may continue on the next lines of the same rank.
    Sizes: <= 1.3 printed ``R cached``, which is cached minus allocated (idle), so it is read as
                    reserved_unallocated_mib (the messages print it below "already allocated", impossible
                    for a total); a message missing its closing parenthesis, wrapped over lines (also
                    mid-word: the pieces are joined with and without a space), pasted from its "Tried to
                    allocate X (GPU N; ..." clause, or THC's pre-1.0 ``cuda runtime error (2) : out of
                    memory`` (gpu_oom, no numbers, confidence medium) still counts.
    gpu_oom_other_process
                    memory held on the card outside this process, ``other``, is ``>= OTHER_PROCESS_SHARE``
                    (10 %) of the capacity AND ``other + free >= tried``: a foreign process (or the driver)
                    holds a real share and without it the request would have fit, so no memory move of
                    ours is the answer. ``other`` is: the "Process P has M" lines of other processes; else
                    (>= 2.1 with "this process has W") capacity - free - W; else (<= 2.0, ROCm/Windows
                    messages without process lines, or every process listed at 0 bytes) capacity - free -
                    PyTorch's reserved memory - ``OWN_CONTEXT_MIB`` (this process's own CUDA context and
                    library workspaces, which the message does not state). Without a "this process has"
                    clause (pid namespaces, containers) this process is the smallest listed one holding at
                    least PyTorch's reserved memory (A + R), since a process holds at least what its
                    allocator reserved (its M is then ``process_in_use_mib``); with no A and R stated, the
                    largest one. Confidence high when the message names the processes or W, else medium.
    gpu_oom_fragmentation
                    idle reserved memory ``R`` (>= 2.1: reserved but unallocated; 1.4-2.0: reserved in
                    total - already allocated; <= 1.3: "cached") could have served the request, alone or
                    with the free memory: ``R + free >= tried``, on any card. Before raising, the caching
                    allocator has already released every whole free segment and retried, so idle reserved
                    memory at OOM time sits in split blocks; expandable segments would have joined it with
                    the free memory, and the allocator setting is the cheapest first move. Confidence high
                    when ``R >= tried``, medium when the free memory is needed too, low when the free memory
                    alone covered the request (then the driver's own fragmentation, or memory freed between
                    the failure and the message, is as likely). Precedence: other_process > fragmentation
                    > gpu_oom.
    gpu_driver_oom  ``CUDA error: out of memory``, ``CUDA driver error: out of memory``,
                    ``CUBLAS_STATUS_ALLOC_FAILED``, ``CUDNN_STATUS_ALLOC_FAILED``,
                    ``cudaErrorMemoryAllocation``, ``CUDA_ERROR_OUT_OF_MEMORY``, ``cudaMalloc... failed: out of
                    memory``; and
                    ``CUDNN_STATUS_NOT_SUPPORTED``, ``CUDNN_STATUS_INTERNAL_ERROR``,
                    ``CUBLAS_STATUS_NOT_INITIALIZED`` only with memory pressure (an "out of memory",
                    "OOM", "ALLOC_FAILED", "failed to allocate"... line) within ``PRESSURE_WINDOW`` (20)
                    lines. Alone, ``CUDNN_STATUS_NOT_SUPPORTED`` is not_oom (an unsupported input) and the
                    other two are unknown (they can hide an OOM, but nothing shows it).
    nccl_oom        ``Cuda failure 'out of memory'`` (NCCL WARN or "Last error:"), ``Failed to CUDA
                    calloc N bytes`` (cause ``device``; N as ``nccl_bytes``, also from a WARN line just after),
                    ``failed to extend /dev/shm/nccl-*``, ``Error while creating/attaching to shared memory
                    segment`` (cause ``shm``: host memory; even after a "No space left on device": /dev/shm is
                    memory) -- except that a segment error next to "Permission denied", "No such file or
                    directory" or a ``Cuda failure`` other than out of memory (cudaHostRegister refused the
                    segment) is not_oom (``nccl_shm_permission`` / ``nccl_shm_attach`` / ``nccl_shm_register``:
                    no memory ran out).
                    A following ``DistBackendError`` line joins the evidence. ``gpu`` is the CUDA device NCCL
                    prints as ``host:pid:tid [N] ... NCCL WARN``.
    host_oom        cause ``cgroup``: ``Detected N oom-kill event(s)`` / ``oom_kill event`` (Slurm cgroup,
                    old and >= 23.02), ``srun: error: node: task N: Out Of Memory``, ``exceeded memory limit
                    ... being killed``, or the record: state ``OUT_OF_MEMORY`` or exit code ``0:125``; cause
                    ``oom_killer``: the kernel's ``Out of memory: Kill(ed) process`` / ``Memory cgroup out of
                    memory`` (its anon-rss as ``host_used_mib``); cause ``shm``: a DataLoader worker's bus
                    error "insufficient shared memory (shm)", or the main process's "DataLoader worker ...
                    killed by signal: Bus error ... workers are out of shared memory" (medium). Confidence
                    high otherwise.
    cpu_alloc_oom   ``DefaultCPUAllocator: can't allocate memory`` / ``not enough memory`` (``you tried
                    to allocate N bytes``, also wrapped), THC's ``Torch: not enough memory``, c10's
                    ``posix_memalign(...) == 0. 12 vs 0`` (ENOMEM), numpy ``Unable to allocate X for an
                    array``, ``MemoryError``, Windows' ``[WinError 1455]`` (paging file, i.e. commit limit).
    SIGKILL         launcher ``exits with return code = -9``, torchrun ``exitcode: -9`` / ``Signal 9
                    (SIGKILL) received``, ``<Signals.SIGKILL: 9>``, exit code/status 137, ``returncode=-9``,
                    a bare ``Killed`` line or one ending a progress bar (``...it/s]Killed``), bash's ``line
                    N: PID Killed``, zsh's ``[1] PID killed``, srun's ``task N: Killed``, a DataLoader worker
                    "killed by signal: Killed"; DeepSpeed's ``sigkill_handler] Killing subprocess`` when no
                    other return code follows; record signal 9 or exit 137 / -9. A lone SIGKILL that is the
                    first failure is host_oom, cause ``sigkill``, confidence ``medium``: the kernel's or
                    Slurm's OOM killer sends nearly all of them (an admin, a health check or a launcher's
                    shutdown send the rest), and ``confirm`` names what settles it (sacct State/MaxRSS
                    against ReqMem, dmesg). It is not the first failure when a Python exception with a
                    message comes before it (not_oom naming it), or when torchrun's "Root Cause (first
                    observed failure)" names another rank or another exit code (unknown,
                    ``child_failed_bare``). The host memory stated just before it (a DeepSpeed
                    ``see_memory_usage`` or monitor line) is ``host_used_mib``.
    not_oom         with ``cause``: device faults (``illegal_memory_access``, ``device_assert``,
                    ``misaligned_address``, ``launch_failure``, ``ecc``); ``DUE TO TIME LIMIT``
                    (``time_limit``), ``DUE TO PREEMPTION``, ``DUE TO NODE FAIL``, ``*** JOB/STEP ..
                    CANCELLED AT`` (``cancelled``), NCCL watchdog timeout (``nccl_timeout``), ``No space
                    left on device`` (``disk_full``), disk quota, ImportError/ModuleNotFoundError
                    (``import_error``), ``command not found``; NaN/Inf stops ("returned nan values", "Loss
                    is nan", "Network outputs is NAN", non-finite loss: ``nan``); ``Segmentation fault``,
                    SIGSEGV, exit -11 / 139 (``segfault``); ``CUDNN_STATUS_NOT_SUPPORTED`` without memory
                    pressure (``cudnn_not_supported``); a crash after training completed (``teardown``, phase
                    teardown: an abort -- ``terminate called without an active exception``, SIGABRT, exit
                    -6 -- or a segfault after HF Trainer's final metrics, "Training completed", a
                    Lightning ``Trainer.fit`` stop, a training progress bar at 100 % (N/N; not a loading,
                    preprocessing or evaluation bar; the last progress line, counting the longest loop in
                    view)...; a segfault whose backtrace runs through the exit
                    handlers; an error inside ``destroy_process_group``); record states TIMEOUT, CANCELLED,
                    PREEMPTED, NODE_FAIL, BOOT_FAIL, DEADLINE, COMPLETED (``completed``); any other Python
                    exception line (``python_error``) except the wrappers that only report a failure
                    elsewhere (ChildFailedError, CalledProcessError, DistBackendError, DistNetworkError,
                    DistStoreError, SignalException, SystemExit).
                    An abort whose ``what():`` line (the next one) states a not-OOM failure is that failure
                    (c10d's watchdog ends a job with "terminate called after throwing an instance of
                    'c10::DistBackendError'" and the timeout on its ``what():`` line). A device assert is
                    also the kernel's own ``block: [..], thread: [..] Assertion `...` failed.`` line.
    unknown         an abort with nothing before it (``sigabrt_no_context``), a launcher's non -9 exit
                    code alone (``exit_code_only``), a torchrun root cause on another rank
                    (``child_failed_bare``), NCCL losing a peer (``nccl_peer``: "Connection closed by remote
                    peer", "remote process exited or there was a network error", ``ncclRemoteError``: another
                    rank died or the network failed, and this rank's error is the consequence), an ambiguous
                    cuDNN/cuBLAS error, or nothing recognisable.

Where and when (``phase``, ``step``, ``total_steps``)
    phase: from the frames of the traceback that ends at the decisive line (same rank; the one just after
    it for a THC check or a logger line printed first; frames a logger wrote without their header), the
    first of ``_PHASE_FRAMES`` any frame shows: teardown (destroy_process_group, exit handlers), data
    (inside a DataLoader worker), checkpoint (save*, state_dict, save_pretrained), eval (evaluate,
    evaluation_loop, prediction_step, validation_step...), generate, load (from_pretrained,
    load_state_dict, Module._apply i.e. ``model.to()/.cuda()``, ``_broadcast_model``, torch.load), optimizer
    (torch/optim, _multi_tensor_*, optimizer.step), backward (backward, autograd), data (DataLoader frames),
    forward. Without a traceback only the failing line itself says it: a DataLoader worker's message ->
    data, a logger's "during eval" -> eval, a "Loading checkpoint shards" bar ended by the kill -> load.
    step: the last progress line at or before the decisive line (tqdm ``n/total [``, ``Epoch: [e][n/total]``,
    ``Step n/total``, ``n/total samples``, "step n"); a bar whose description names loading or
    preprocessing (Loading, Map, Filter, Tokenizing, Downloading, shards...) is not a step.

Confidence (``confidence``, ``confirm``)
    high: the text shows the mechanism; medium: the usual cause of what is shown (a lone SIGKILL, an old
    message's memory outside the cache, idle cache that covers the request only with the free memory, a
    message without numbers); low: a guess (free memory alone covered the request, a bare abort, nothing
    found). ``confirm`` says what would raise it.

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
    5. The first in the log of: other not-OOM signatures, SIGKILL, segfault, abort, ambiguous
       cuDNN/cuBLAS error. A segfault or abort after training completed -> not_oom teardown (not a
       SIGKILL: writing the final model can run out of host memory);
       a not-OOM signature -> not_oom; anything when the record says the scheduler ended the job
       (TIMEOUT, CANCELLED, ...) -> not_oom; a SIGKILL or abort after a Python exception -> not_oom
       naming the exception; a segfault -> not_oom segfault; a SIGKILL -> host_oom (medium) unless
       torchrun's root cause is another rank (unknown); an abort -> unknown; ambiguous -> unknown.
    6. Record state TIMEOUT, CANCELLED, PREEMPTED, NODE_FAIL, BOOT_FAIL, DEADLINE -> not_oom.
    7. Record SIGKILL -> host_oom, cause sigkill, medium.
    8. NCCL losing a peer with no Python exception -> unknown (nccl_peer): the other rank's failure, which an
       OOM there may be, is not in the log. Then DeepSpeed's "Killing subprocess" with no Python exception:
       host_oom (medium) when no other return code follows, else unknown (exit_code_only).
    9. The first non-wrapper Python exception line -> not_oom naming it (teardown when its frames are
       in destroy_process_group).
    10. A traceback frame in destroy_process_group -> not_oom teardown; otherwise unknown.
"""

from __future__ import annotations

import os
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from .logtail import DEFAULT_MAX_BYTES, Tail, read_head, read_tail

from .failures import KINDS, OOM_KINDS, SHM_CAUSE  # noqa: E402  (the one table of failure kinds)

OTHER_PROCESS_SHARE = 0.10
"""Other processes must hold this share of the GPU's capacity to blame them for an OOM."""
CAPACITY_UNKNOWN_FLOOR_MIB = 1024.0
"""Stands in for a share of the capacity when a message does not state the capacity (MiB)."""
OWN_CONTEXT_MIB = 1024.0
"""What this process itself holds outside PyTorch's cache when the message does not say (<= 2.0, or >= 2.1 without
"this process has"): its CUDA context with cuBLAS/cuDNN loaded, NCCL's buffers. The >= 2.1 messages that state it
(W - allocated - reserved-unallocated) put it at 0.15-1.4 GiB, most below 1 GiB; memory outside the cache beyond
this is another process's or the driver's."""
PHASES = ("load", "forward", "backward", "optimizer", "eval", "generate", "checkpoint", "data", "teardown")
TRACEBACK_WINDOW = 400
"""Lines before a decisive line searched for the start of its traceback."""
MAX_EVIDENCE = 10
PRESSURE_WINDOW = 20
"""Lines either side of a cuDNN/cuBLAS error searched for signs of memory pressure."""
RANK_WINDOW = 50
"""Lines after a rank-less OOM line searched for the same failure on a rank-prefixed line."""

_SIGKILL_REASON = "killed by SIGKILL, probably host memory; confirm with sacct"
SIGKILL_CONFIRM = ("`sacct -j JOBID -o JobID,State,ExitCode,MaxRSS,ReqMem` (State OUT_OF_MEMORY, or MaxRSS near "
                   "ReqMem), or the node's kernel log (`dmesg -T | grep -i oom`: the OOM killer names the process)")


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
    reserved_total_mib, other_process_mib, allowed_mib (the cap ``set_per_process_memory_fraction`` set: the
    message's capacity and free memory are still the card's)."""
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
    cause: str | None = None
    """A short cause for not_oom / unknown / host_oom / nccl_oom (``segfault``, ``sigkill``, ``shm``, ...);
    None for the GPU kinds."""
    confidence: str = "high"
    """high | medium | low: how sure the verdict is from what was read."""
    confirm: str = ""
    """What would raise the confidence (empty when it is high)."""
    phase: str | None = None
    """Where it died: one of ``PHASES``, from the failing traceback's frames (None: not said)."""
    step: int | None = None
    """The training step at death from the last progress line before the failure (None: not said)."""
    total_steps: int | None = None
    deepspeed_version: str | None = None
    """The DeepSpeed the job ran, as its engine printed it (``DeepSpeed info: version=0.14.4, ...``) or ``ds_report``
    did; None: not in the text read. Older DeepSpeed allocates differently (``estimate.gpu.Runtime``)."""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown verdict kind {self.kind!r}; valid: {', '.join(KINDS)}")
        if self.confidence not in ("high", "medium", "low"):
            raise ValueError(f"unknown confidence {self.confidence!r}; valid: high, medium, low")

    @property
    def is_oom(self) -> bool:
        """True for the seven out-of-memory kinds."""
        return self.kind in OOM_KINDS

    def to_dict(self) -> dict:
        """JSON-ready: kind, numbers, gpu, rank, evidence [{line, text}], reason, ranks, cause, confidence,
        confirm, phase, step, total_steps, deepspeed_version."""
        return {
            "kind": self.kind,
            "numbers": dict(self.numbers),
            "gpu": self.gpu,
            "rank": self.rank,
            "evidence": [{"line": n, "text": s} for n, s in self.evidence],
            "reason": self.reason,
            "ranks": [dict(r) for r in self.ranks],
            "cause": self.cause,
            "confidence": self.confidence,
            "confirm": self.confirm,
            "phase": self.phase,
            "step": self.step,
            "total_steps": self.total_steps,
            "deepspeed_version": self.deepspeed_version,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Verdict":
        """The inverse of ``to_dict`` (a verdict read back from the ledger)."""
        return cls(kind=data["kind"], numbers=dict(data.get("numbers") or {}), gpu=data.get("gpu"),
                   rank=data.get("rank"), reason=data.get("reason", ""),
                   evidence=tuple((e["line"], e["text"]) for e in data.get("evidence") or ()),
                   ranks=tuple(dict(r) for r in data.get("ranks") or ()), cause=data.get("cause"),
                   confidence=data.get("confidence") or "high", confirm=data.get("confirm") or "",
                   phase=data.get("phase"), step=data.get("step"), total_steps=data.get("total_steps"),
                   deepspeed_version=data.get("deepspeed_version"))


# --------------------------------------------------------------------------- sizes

_UNIT_MIB = {"": 1 / 2**20, "K": 1 / 1024, "M": 1.0, "G": 1024.0, "T": 1024.0**2}
_SIZE = r"\d+(?:\.\d+|\.(?=\s))?\s*(?i:[KMGT]i?B|[KMGT]|bytes?|B)\b"
_SIZE_PARTS = re.compile(r"\s*(\d+(?:\.\d*)?)\s*(?i:([KMGT])i?B?|bytes?|B)\s*\Z")


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
    mib = float(m.group(1)) * _UNIT_MIB[(m.group(2) or "").upper()]
    if not math.isfinite(mib):  # 300 digits read as a float: no memory is that size
        raise ValueError(f"not a size: {text[:40]!r}")
    return mib


MOST_STATED_MIB = 2.0**40
"""A size a message states above this (an exbibyte) is no memory's: read as not stated."""


def _stated_mib(text: str) -> float | None:
    """A size a message states, in MiB; None for one no memory can be (a 300-digit number, an overflow)."""
    try:
        mib = parse_size_to_mib(text)
    except ValueError:
        return None
    return mib if mib <= MOST_STATED_MIB else None


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
    cause: str | None = None  # a short cause (see Verdict.cause)
    confidence: str = "high"
    confirm: str = ""  # what would raise the confidence


def _sig(*patterns: str) -> re.Pattern:
    return re.compile("|".join(f"(?:{p})" for p in patterns))


_GPU_OOM = _sig(
    r"(?:Error|Exception):\s*(?:CUDA|HIP|XPU|MPS backend) out of memory",  # an exception line
    r"(?:CUDA|HIP|XPU) out of memory\.\s*Tried to allocate",  # the message, logged without the exception name
    r"^Tried to allocate \S+ \S+ \(GPU \d+; ",  # the allocator's own clause (a message pasted from its middle)
)

# (group, kind or label, detail for the reason, pattern); the first match on a line wins.
_SIGNATURES = (
    ("oom", "nccl_oom", "NCCL could not allocate device memory",
     _sig(r"Cuda failure (?:\d+ )?'?out of memory", r"Failed to CUDA calloc")),
    ("oom", "nccl_oom", "NCCL could not extend its shared memory in /dev/shm",
     _sig(r"failed to extend /dev/shm/nccl", r"Error while (?:creating|attaching to) shared memory segment")),
    ("oom", "gpu_driver_oom", "", _sig(
        r"CUDA (?:driver )?error: out of memory", r"CUBLAS_STATUS_ALLOC_FAILED", r"CUDNN_STATUS_ALLOC_FAILED",
        r"cudaErrorMemoryAllocation", r"CUDA_ERROR_OUT_OF_MEMORY", r"\bcudaMalloc\w* failed\W.*out of memory")),
    ("oom", "gpu_oom", "CUDA out of memory (THC, PyTorch < 1.0)",
     _sig(r"cuda runtime error \(2\) : out of memory", r"THCudaCheck FAIL .*error=2 : out of memory")),
    ("oom", "cpu_alloc_oom", "", _sig(
        r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory)", r"Unable to allocate .+ for an array",
        r"^(?:[\w.]+\.)?MemoryError\b", r"Torch: not enough memory", r"posix_memalign\(.*\) == 0\. 12 vs 0",
        r"WinError 1455\b")),  # Windows: the paging file (commit limit) is exhausted
    ("oom", "host_oom", "the Slurm cgroup out-of-memory handler killed a task",
     _sig(r"Detected \d+ oom[-_ ]kill event")),
    ("oom", "host_oom", "srun reported a task out of memory", _sig(r"\btasks? [\d,\-]+: Out Of Memory")),
    ("oom", "host_oom", "Slurm killed the job for exceeding its memory limit",
     _sig(r"exceeded memory limit.*being killed", r"Exceeded job memory limit\s*$")),
    ("oom", "host_oom", "the kernel's OOM killer killed a process",
     _sig(r"Memory cgroup out of memory: Kill", r"Out of memory: Kill(?:ed)? process", r"invoked oom-killer",
          r"oom-kill:constraint")),
    ("oom", "host_oom", "a DataLoader worker hit a bus error from a full /dev/shm",
     _sig(r"insufficient shared memory \(shm\)",  # the worker's own message
          r"workers are out of shared memory")),  # the main process's RuntimeError about the dead worker
    ("fault", "illegal memory access", "", _sig(r"an illegal memory access was encountered")),
    ("fault", "device-side assert", "", _sig(
        r"device-side assert(?:ion)? triggered",
        r"block: \[\d+,\s*\d+,\s*\d+\],? thread: \[\d+,\s*\d+,\s*\d+\],? Assertion .* failed")),  # the kernel's line
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
    ("not_oom", "import error", "", _sig(
        r"^(?:\[stderr\])?(?:[\w.]+\.)?(?:ImportError|ModuleNotFoundError)\b",
        # runpy, for `python -m torch.distributed.run` (or deepspeed's launcher) when the package is missing:
        # "python3: Error while finding module specification for 'x.y' (ModuleNotFoundError: No module named 'x')"
        # and "python3: No module named x"
        r"Error while finding module specification for '[\w.]+' \((?:ModuleNotFoundError|ImportError)\b",
        r"^\S*python[\d.]*: No module named [\w.]+\s*$")),
    ("not_oom", "command not found", "",
     _sig(r"command not found\s*$", r"execve\(\): .*No such file or directory")),
    ("not_oom", "NaN/Inf in the loss or gradients", "", _sig(  # the stops, not a loss scaler's skipped steps
        r"returned nan values in its", r"\b[Ll]oss is (?:nan|NaN|inf)\b.*\b[Ss]top", r"\bNA?N\b.*\b[Ss]top",
        r"(?:Error|Exception):.*\b(?:nan|NaN|NAN|[Nn]on-finite)\b")),
    ("segfault", "segmentation fault", "", _sig(
        r"Segmentation fault", r"\bSIGSEGV\b", r"exitcode\s*:\s*-11\b", r"exits with return code = -11\b",
        r"\bexit code 139\b", r"Signals\.SIGSEGV", r"Signal 11\b",
        r"exit code -1073741819\b", r"0xC0000005")),  # Windows' access violation
    ("abort", "SIGABRT", "", _sig(
        r"terminate called without an active exception", r"terminate called after throwing an instance of",
        r"^\s*Aborted(?: \(core dumped\))?\s*$",
        r"Signal 6 \(SIGABRT\)", r"exitcode\s*:\s*-6\b", r"exits with return code = -6\b", r"Signals\.SIGABRT")),
    ("sigkill", "SIGKILL", "", _sig(
        r"exits with return code = -9\b", r"exitcode\s*:\s*-9\b", r"Signal 9 \(SIGKILL\)", r"Signals\.SIGKILL",
        r"\bexit (?:code|status)\s*[=:]?\s*137\b", r"^\s*[Kk]illed\s*$", r"\]\s*Killed\s*$", r"line \d+:\s*\d+ Killed\b",
        r"\btasks? [\d,\-]+: Killed\b", r"killed by signal: Killed", r"\[\d+\]\s+\d+ killed\s",
        r"\breturn ?code\s*[=:]\s*-9\b", r"^\[\d+\][+-]?\s+Killed\s")),
    ("launcher_kill", "the launcher killed its subprocesses", "", _sig(r"sigkill_handler\] Killing subprocess")),
    ("peer", "NCCL lost its connection to a peer", "", _sig(
        r"Connection closed by remote peer", r"remote process exited or there was a network error",
        r"\bncclRemoteError\b")),
    ("disguised", "CUDNN_STATUS_NOT_SUPPORTED", "", _sig(r"CUDNN_STATUS_NOT_SUPPORTED")),
    ("disguised", "CUDNN_STATUS_INTERNAL_ERROR", "", _sig(r"CUDNN_STATUS_INTERNAL_ERROR")),
    ("disguised", "CUBLAS_STATUS_NOT_INITIALIZED", "", _sig(r"CUBLAS_STATUS_NOT_INITIALIZED")),
)
# Words one of which a line must contain before the (slow, many-branched) SIGKILL pattern runs.
_SIGKILL_WORDS = ("-9", "137", "SIGKILL", "Killed", "killed")
_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\)")
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
_RETURN_CODE = re.compile(r"exits with return code = (-?\d+)")
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
# Cheap test run on every line; a line that fails it cannot match any signature above. Its alternatives are grouped
# by their first character: Python's re then rejects most positions of a line at one branch instead of trying each.
_PREFILTER_WORDS = (
    "out of memory", "Out Of Memory", "Out of memory", "oom", "ALLOC_FAILED", "MemoryAllocation", "OUT_OF_MEMORY",
    "MemoryError", "calloc", "/dev/shm", "shared memory", "Unable to allocate", "DefaultCPUAllocator", "memory limit",
    "illegal memory", "device-side", "Assertion", "misaligned", "launch failure", "ECC", "DUE TO", "CANCELLED", "Watchdog",
    "Timeout at NCCL", "No space", "Errno", "quota", "not found", "execve", "-9", "137", "SIGKILL", "SIGSEGV",
    "Killed", "killed", "Killing subprocess", "CUDNN_STATUS", "CUBLAS_STATUS", "Error", "Exception", "Interrupt",
    "Exit", "Failure", "Tried to allocate", "cuda runtime error", "THCudaCheck", "not enough memory",
    "posix_memalign", "WinError 1455", "No module named", "MPS backend", "XPU out", "nan values", r"s (?:nan|NaN|NAN|inf)\b", "NAN", "NaN", "on-finite", "Segmentation",
    r"exit ?code", "return code", "Signal", "terminate called", "Aborted", "0xC0000005", "remote peer",
    "network error",
)


def _grouped(alternatives) -> re.Pattern:
    by_first: dict[str, list[str]] = {}
    for alt in alternatives:
        by_first.setdefault(alt[0], []).append(alt)
    return re.compile("|".join(f"(?:{'|'.join(alts)})" if len(alts) > 1 else alts[0] for alts in by_first.values()))


_PREFILTER = _grouped(_PREFILTER_WORDS)


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
    m = _EXCEPTION.match(body.lstrip())  # an indented paste (a markdown code block) keeps its exception lines
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


_HOST_CAUSE = {
    "the Slurm cgroup out-of-memory handler killed a task": "cgroup",
    "srun reported a task out of memory": "cgroup",
    "Slurm killed the job for exceeding its memory limit": "cgroup",
    "the kernel's OOM killer killed a process": "oom_killer",
    "a DataLoader worker hit a bus error from a full /dev/shm": SHM_CAUSE,
}
_ANON_RSS = re.compile(r"anon-rss:\s*(\d+)\s*kB")
_HOST_USED = re.compile(r"(?:CPU Virtual Memory|RAM|[Mm]emory)[^\n]{0,20}?used\s*[=:]\s*(" + _SIZE + ")")


def _simple_event(log: _Log, i: int, group: str, kind: str, detail: str) -> _Event:
    body = log.body(i)
    rank = _rank(log, i)
    gpu = numbers = None
    cause = None
    confidence = "high"
    lines = (i,)
    confirm = ""
    if kind == "gpu_oom":  # THC's message states no numbers: plain or fragmentation cannot be told apart
        confidence, confirm = "medium", "the allocator's numbers (PyTorch >= 1.0 states them in its message)"
    if kind == "host_oom":
        cause = _HOST_CAUSE.get(detail)
        confidence = "medium" if cause == SHM_CAUSE else "high"
        if rank is None:
            m = re.search(r"\btask (\d+): Out Of Memory", body)
            rank = int(m.group(1)) if m else None
        m = _ANON_RSS.search(" ".join(log.body(j) for j in range(i, min(i + 3, len(log)))))
        if m:
            numbers = {"host_used_mib": int(m.group(1)) / 1024}
    if kind == "nccl_oom":
        m = re.match(r"\S+:\d+:\d+ \[(\d+)\] .*NCCL WARN", body)  # host:pid:tid [cudaDev] file:line NCCL WARN
        gpu = int(m.group(1)) if m else None
        shm = "shared memory" in detail
        cause = SHM_CAUSE if shm else "device"
        m = re.search(r"(?:calloc(?: async)?|to) (\d+) bytes", body) or re.search(r"\(size (\d+)\)", body)
        if m is None and not shm:  # "Cuda failure 'out of memory'" first, the size on a later WARN line
            m = next((x for x in (re.search(r"Failed to CUDA calloc(?: async)? (\d+) bytes", log.raw[j])
                                  for j in range(i + 1, min(len(log), i + 20))) if x), None)
        if m:
            numbers = {"nccl_bytes": int(m.group(1))}
            if not shm:
                numbers["tried_to_allocate_mib"] = int(m.group(1)) / 2**20
        if shm:
            near = " ".join(log.body(j) for j in range(max(0, i - 4), min(i + 2, len(log))))
            if "Permission denied" in near:
                return _Event(i, "not_oom", "NCCL could not create its shared-memory segment: permission denied", rank,
                              gpu, numbers or {}, lines, cause="nccl_shm_permission")
            failure = re.search(r"Cuda failure (?:\d+ )?'([^']*)'", near)  # newer NCCL prints the error's number
            if failure and "out of memory" not in failure.group(1):
                return _Event(i, "not_oom", f"NCCL could not register its shared-memory segment with CUDA "
                              f"(cudaHostRegister: '{failure.group(1)}'); no memory ran out", rank, gpu,
                              numbers or {}, lines, cause="nccl_shm_register")
            if "No such file or directory" in near:
                return _Event(i, "not_oom", "NCCL could not attach to a shared-memory segment that is not there "
                              "(another process removed it, or /dev/shm is not shared)", rank, gpu, numbers or {},
                              lines, cause="nccl_shm_attach")
        lines += _following(log, i, "DistBackendError", 80)
    if kind == "cpu_alloc_oom":
        text = " ".join(log.body(j) for j in range(i, min(i + 2, len(log))))  # "you\ntried to allocate" wraps
        m = re.search(r"you\s+tried\s+to\s+allocate\s+(\d+) bytes", text)
        if m:
            numbers = {"tried_to_allocate_mib": int(m.group(1)) / 2**20}
        m = re.search(r"you tried to allocate (\d+(?:\.\d+)?)\s*GB", body)  # THC "Torch: not enough memory"
        if m:
            numbers = {"tried_to_allocate_mib": float(m.group(1)) * 1024}
        m = re.search(r"Unable to allocate (" + _SIZE + ")", body)
        if m:
            size = _stated_mib(m.group(1))
            numbers = {"tried_to_allocate_mib": size} if size else {}
    return _Event(i, group, kind, rank, gpu, numbers or {}, lines, detail, cause, confidence, confirm)


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
    "allowed_mib": re.compile(r"(" + _SIZE + r") allowed;"),  # set_per_process_memory_fraction's cap
}
_NEW_GPU = re.compile(r"GPU (\d+) has a total capaci?ty")
_PROCESS = re.compile(r"Process (\d+) has (" + _SIZE + r") memory in use")
_OLD = re.compile(r"\(GPU (\d+); ([^)]*?)(?:\)|\s*$)")
_OLD_CLAUSES = (
    ("total_capacity_mib", "total capacity"),
    ("already_allocated_mib", "already allocated"),
    ("free_mib", "free"),
    ("reserved_total_mib", "reserved in total"),
    ("reserved_unallocated_mib", "cached"),  # 1.0-1.3: "cached" is cached minus allocated (idle), see below
)
_CLAUSE = re.compile(r"\s*(" + _SIZE + r")\s+(.*?)\s*$")


def _gpu_oom_event(log: _Log, i: int) -> _Event:
    """A caching-allocator OOM: parse its numbers, decide plain / fragmentation / other process."""
    lines = (i,) + _continuation(log, i)
    bodies = [log.body(j) for j in lines]
    numbers, gpu, processes, has_self = _oom_numbers(" ".join(bodies))
    if len(bodies) > 1 or "total_capacity_mib" not in numbers:  # a terminal or logger wrapped it; a hard wrap can split a word ("P\nyTorch")
        more, more_gpu, more_processes, more_self = _oom_numbers("".join(bodies))
        numbers = {**more, **numbers}
        gpu = gpu if gpu is not None else more_gpu
        processes = processes or more_processes
        has_self = has_self or more_self
    if has_self and not numbers["process_in_use_mib"] and not any(processes):
        processes, has_self = [], False  # every process "has 0 bytes": the driver gave no per-process figures
    own = _own_process(numbers, processes, has_self)
    if own is not None and "process_in_use_mib" not in numbers:
        numbers["process_in_use_mib"] = own  # "Process P has M" is this process (a container's pid namespace)
    other = _other_process_mib(numbers, processes, has_self, own)
    if other > 0 and processes:
        numbers["other_process_mib"] = other
    kind, confidence, confirm = _gpu_kind(numbers, other, bool(processes) or has_self)
    if kind == "gpu_oom_other_process" and "other_process_mib" not in numbers:
        numbers["other_process_mib"] = round(other, 2)  # derived: what the card holds outside this process
    return _Event(i, "oom", kind, _rank(log, i), gpu, numbers, lines, "CUDA out of memory",
                  confidence=confidence, confirm=confirm)


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
        if not body.strip() or _GPU_OOM.search(body):
            break
        if not _OOM_CLAUSES.search(body) and not _WRAPPED_PIECE.match(body):
            break
        found.append(j)
        if _OOM_END.search(body):
            break
    return tuple(found)


# A hard-wrapped piece of an OOM message: starts mid-word or mid-number, or with one of the message's words.
_WRAPPED_PIECE = re.compile(r"^(?:[a-z]\w*|\d[\d.]*\s*[KMGT]i?B|[KMGT]iB|iB)\b")


def _oom_numbers(message: str) -> tuple[dict, int | None, list, bool]:
    """(numbers in MiB, gpu, "Process P has M" usages in MiB, whether "this process has" was stated)."""
    numbers: dict[str, float] = {}
    gpu = None
    old = _OLD.search(message)
    if old:
        gpu = int(old.group(1))
        for clause in old.group(2).split(";"):
            m = _CLAUSE.match(clause)
            if m:
                name = next((n for n, label in _OLD_CLAUSES if m.group(2).startswith(label)), None)
                size = _stated_mib(m.group(1))
                if name and name not in numbers and size is not None:
                    numbers[name] = size
    m = _NEW_GPU.search(message)
    if m:
        gpu = int(m.group(1))
    for name, pattern in _NEW.items():
        m = pattern.search(message)
        size = _stated_mib(m.group(1)) if m else None
        if size is not None and name not in numbers:
            numbers[name] = size
    processes = [x for x in (_stated_mib(m.group(2)) for m in _PROCESS.finditer(message)) if x is not None]
    return numbers, gpu, processes, "process_in_use_mib" in numbers


def _reserved_mib(numbers: Mapping) -> float | None:
    """All PyTorch's cache holds: A + R (>= 2.1), reserved in total (1.4-2.0), already allocated + cached (<= 1.3)."""
    if "reserved_total_mib" in numbers:
        return numbers["reserved_total_mib"]
    allocated = numbers.get("allocated_by_pytorch_mib", numbers.get("already_allocated_mib"))
    if allocated is not None and "reserved_unallocated_mib" in numbers:
        return allocated + numbers["reserved_unallocated_mib"]
    return None


def _own_process(numbers: Mapping, processes: list, has_self: bool) -> float | None:
    """Which "Process P has M" line is this process when the message has no "this process has W" (see the docstring)."""
    if has_self or not processes:
        return None
    reserved = _reserved_mib(numbers)
    if reserved is not None:
        mine = [p for p in processes if p >= reserved]
        return min(mine) if mine else None
    return max(processes)


def _other_process_mib(numbers: Mapping, processes: list, has_self: bool, own: float | None) -> float:
    """MiB held on the card outside this process (see the module docstring for the rule)."""
    total, free = numbers.get("total_capacity_mib"), numbers.get("free_mib")
    if processes:
        listed = sum(processes) - (own or 0.0)
        if has_self or own is not None or total is None or free is None:
            return listed
    if total is None or free is None:
        return 0.0
    if has_self:  # >= 2.1: what is in use and not this process's
        return max(0.0, total - free - numbers["process_in_use_mib"])
    reserved = _reserved_mib(numbers)
    if reserved is None:
        return 0.0
    return max(0.0, total - free - reserved - OWN_CONTEXT_MIB)


def _share_floor(numbers: Mapping, share: float) -> float:
    total = numbers.get("total_capacity_mib")
    return share * total if total else CAPACITY_UNKNOWN_FLOOR_MIB


def binding_cap_mib(numbers: Mapping) -> float | None:
    """The memory-fraction cap the message states ("N allowed;", MiB) when it is below the card's capacity (a cap
    at or above it limits nothing); None otherwise. The cap bounds what the caching allocator reserves; the CUDA
    context and libraries lie outside it."""
    allowed, total = numbers.get("allowed_mib"), numbers.get("total_capacity_mib")
    if allowed is not None and (total is None or allowed < total):
        return allowed
    return None


def usable_capacity_mib(numbers: Mapping) -> float | None:
    """The GPU memory the failed process could use (MiB): the cap a memory fraction set (``binding_cap_mib``) when
    the message states one, else the card's capacity; None when the message states neither."""
    cap = binding_cap_mib(numbers)
    return cap if cap is not None else numbers.get("total_capacity_mib")


def _capped_free_mib(numbers: Mapping) -> float | None:
    """Under a memory-fraction cap the allocator refuses a segment once its reserved memory plus the request would
    pass the cap, whatever the card has free (``CUDACachingAllocator.cpp``: ``allowed_memory_maximum``): the memory
    the cap left, when the card itself had room for the request; None otherwise. Where the message's PyTorch
    figures are cut off (a log line that shortened it), this process's whole use (``this process has W``, at least
    what its allocator reserved, and more: its CUDA context is outside the cap) bounds the room from below; with
    neither, the cap left none that counts."""
    allowed, tried, free = binding_cap_mib(numbers), numbers.get("tried_to_allocate_mib"), numbers.get("free_mib")
    if allowed is None or tried is None or (free is not None and free < tried):
        return None
    reserved = _reserved_mib(numbers)
    if reserved is None:
        reserved = numbers.get("process_in_use_mib", allowed)
    return max(0.0, allowed - reserved)


def _gpu_kind(numbers: Mapping, other: float, stated: bool) -> tuple[str, str, str]:
    """(kind, confidence, what would raise it): other_process > fragmentation > gpu_oom (module docstring)."""
    tried = numbers.get("tried_to_allocate_mib")
    if tried is None:
        return "gpu_oom", "medium", "the message's numbers (the whole 'CUDA out of memory. Tried to allocate ...' line)"
    free = numbers.get("free_mib", 0.0)
    capped = _capped_free_mib(numbers)
    if capped is not None:  # the cap refused it: other processes did not, and only the cap's room counts as free
        free, other = capped, 0.0
    if other >= _share_floor(numbers, OTHER_PROCESS_SHARE) and other + free >= tried:
        if stated:
            return "gpu_oom_other_process", "high", ""
        return ("gpu_oom_other_process", "medium",
                "nvidia-smi on the node while the job runs (which processes hold the GPU); PyTorch >= 2.1 names them")
    idle = _idle_reserved_mib(numbers)
    if idle is not None and idle + free >= tried:
        if idle >= tried:
            return "gpu_oom_fragmentation", "high", ""
        if free >= tried:
            return ("gpu_oom_fragmentation", "low", "torch.cuda.memory_snapshot() at the failure: the reported free "
                    "memory alone covered the request, so the driver's own fragmentation or a change between the "
                    "failure and the message is as likely")
        return ("gpu_oom_fragmentation", "medium", "torch.cuda.memory_snapshot() at the failure (the idle cache "
                "covers the request only together with the free memory)")
    if idle is None:
        return "gpu_oom", "medium", "the message's reserved/allocated figures (cut from this log)"
    return "gpu_oom", "high", ""


def _idle_reserved_mib(numbers: Mapping) -> float | None:
    """Reserved but unallocated MiB (>= 2.1; <= 1.3 "cached"), or reserved in total - already allocated (1.4-2.0)."""
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
    event, verdict = _decide(rec, events, log)
    verdict = replace(_where_when(verdict, event, log), deepspeed_version=deepspeed_version(text))
    return _finish(verdict, event, events, log), (event.index if event else None)


HEAD_BYTES = 2**20
"""How much of a log's head is read for what start-up prints (the DeepSpeed version) when the tail skipped it."""
_DEEPSPEED_VERSION = re.compile(r"DeepSpeed info: version=(\d{1,6}\.\d{1,6}(?:\.\d{1,6})?)(?!\d)"  # the engine
                                r"|deepspeed info \.+ (\d{1,6}\.\d{1,6}(?:\.\d{1,6})?)(?!\d)")  # ds_report


def deepspeed_version(text: str) -> str | None:
    """The DeepSpeed version the log states (the last one, should a log hold several runs); None if none (pure)."""
    found = None
    for m in _DEEPSPEED_VERSION.finditer(text):
        found = m.group(1) or m.group(2)
    return found


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


_CAUSES = {  # the not_oom labels of the signatures -> Verdict.cause
    "time limit": "time_limit", "preempted": "preempted", "node failure": "node_fail", "cancelled": "cancelled",
    "NCCL watchdog timeout": "nccl_timeout", "disk full": "disk_full", "disk quota exceeded": "disk_quota",
    "import error": "import_error", "command not found": "command_not_found",
    "NaN/Inf in the loss or gradients": "nan", "illegal memory access": "illegal_memory_access",
    "device-side assert": "device_assert", "misaligned address": "misaligned_address",
    "unspecified launch failure": "launch_failure", "uncorrectable ECC error": "ecc",
    "segmentation fault": "segfault", "completed": "completed", "interrupted": "interrupted",
}
_STATE_CAUSES = {"TIMEOUT": "time_limit", "CANCELLED": "cancelled", "PREEMPTED": "preempted",
                 "NODE_FAIL": "node_fail", "BOOT_FAIL": "node_fail", "DEADLINE": "time_limit"}
_COMPLETED = re.compile(
    r"'train_runtime'|\btrain_runtime\b|\*{3,} train metrics \*{3,}|Training completed|[Tt]raining (?:is )?"
    r"(?:complete|finished|done)\b|Finished training|`Trainer\.fit` stopped|[Tt]raining took \d|"
    r"[Tt]otal training time")
"""Lines saying training finished (HF Trainer's final metrics, Lightning, Ray, common scripts)."""
_EXIT_FRAMES = re.compile(r"__run_exit_handlers|Py_Finalize|_PyRuntime_Finalize|\batexit\b|destroy_process_group")


def _decide(rec: JobRecord, events: list, log: _Log) -> tuple[_Event | None, Verdict]:
    """Apply the precedence rules; returns the decisive event (if any) and a verdict without evidence."""
    oom, fault = _first(events, "oom"), _first(events, "fault")
    if oom and not (fault and fault.index < oom.index):
        return oom, _oom_verdict(oom, rec)
    if _record_host_oom(rec):
        reason = f"Host memory ran out: the scheduler recorded {_describe_record(rec)}."
        return None, Verdict("host_oom", reason=reason, cause="cgroup")
    if rec.state == "COMPLETED":
        return None, Verdict("not_oom", reason="The job completed.", cause="completed")
    if fault:
        return fault, _not_oom(fault.kind, fault.rank)
    cause = _first(events, "not_oom", "sigkill", "ambiguous", "segfault", "abort")
    if cause and cause.group == "abort":
        cause = _abort_told(log, events, cause) or cause
    exc = _first(events, "exception")
    if cause and cause.group in ("segfault", "abort"):  # not a SIGKILL: saving the final model can run out of RAM
        done = _completed_before(log, cause.index)
        if done is not None or _exit_frames_near(log, cause.index):
            what = "a segmentation fault" if cause.group == "segfault" else "an abort (SIGABRT)"
            said = "training had completed" if done is not None else "the crash is in the interpreter's exit handlers"
            return cause, Verdict("not_oom", rank=cause.rank, cause="teardown", phase="teardown", reason=(
                f"Training completed, then the process crashed in teardown{_on(cause.rank)}: {what} after {said}."))
    if cause and cause.group == "not_oom":
        return cause, _not_oom(cause.kind, cause.rank, cause=cause.cause)
    if cause and rec.state in _STATE_REASONS:
        return cause, _not_oom(_STATE_REASONS[rec.state], cause.rank, f"the scheduler recorded {rec.state}",
                               cause=_STATE_CAUSES.get(rec.state))
    if cause and cause.group == "sigkill":
        ended = next((e for e in events if e.group == "not_oom" and e.index > cause.index
                      and e.kind in ("time limit", "preempted", "node failure", "cancelled")), None)
        if ended is not None:  # Slurm kills the tasks when it ends the job: the SIGKILL is its consequence
            return ended, _not_oom(ended.kind, ended.rank, "the SIGKILL before it is the scheduler's")
        root = _root_cause_exit(log, cause.index, cause.rank)
        if root is not None and root != -9:  # a torchrun summary whose first failure is another rank's
            said = "was on another rank" if root == "another rank" else f"exited with code {root}"
            return cause, Verdict("unknown", rank=cause.rank, cause="child_failed_bare", confidence="low",
                                  reason=f"The first observed failure (torchrun's root cause) {said} "
                                         "and its cause is not in the log; the SIGKILL that followed is the "
                                         "launcher's shutdown.", confirm="the failing rank's own log (run with "
                                         "@record or --tee 3 to keep its traceback)")
    if cause and exc and exc.index < cause.index and cause.group in ("sigkill", "abort") and ": " in exc.detail:
        return exc, _not_oom(exc.kind, exc.rank, "the first failure; the kill that followed is its consequence",
                             cause="python_error")
    if cause and cause.group == "segfault":
        return cause, _not_oom("segmentation fault (SIGSEGV)", cause.rank, cause="segfault")
    if cause and cause.group == "sigkill":
        reason = (f"A process was killed by SIGKILL{_on(cause.rank)} with no out-of-memory record: almost always "
                  f"the kernel's or Slurm's out-of-memory kill (host memory).")
        return cause, Verdict("host_oom", _host_used(log, cause.index), rank=cause.rank, reason=reason,
                              cause="sigkill", confidence="medium", confirm=SIGKILL_CONFIRM)
    if cause and cause.group == "abort":
        return cause, Verdict("unknown", rank=cause.rank, cause="sigabrt_no_context", confidence="low",
                              reason=f"A process aborted (SIGABRT){_on(cause.rank)} with nothing before it saying "
                                     "why.", confirm="the rank's own log or a core dump (the abort's backtrace)")
    if cause:
        return cause, Verdict("unknown", rank=cause.rank, reason=f"{cause.detail}.", cause="ambiguous",
                              confidence="low", confirm="the lines around it with NCCL_DEBUG=INFO / "
                              "CUDA_LAUNCH_BLOCKING=1, or torch.cuda.memory_summary() at the failure")
    if rec.state in _STATE_REASONS:
        return None, _not_oom(_STATE_REASONS[rec.state], None, f"the scheduler recorded {rec.state}",
                              cause=_STATE_CAUSES.get(rec.state))
    if _record_sigkill(rec):
        return None, Verdict("host_oom", cause="sigkill", confidence="medium", confirm=SIGKILL_CONFIRM,
                             reason=f"The job was killed by SIGKILL ({_describe_record(rec)}) with no "
                                    "out-of-memory record: almost always host memory.")
    peer = _first(events, "peer")
    if peer and not exc:  # a collective failed because a peer (or the network) went away: the cause is elsewhere
        return peer, Verdict("unknown", rank=peer.rank, cause="nccl_peer", confidence="low", reason=(
            f"NCCL lost its connection to a peer{_on(peer.rank)} ({peer.detail}): another rank died or the network "
            "failed, and that cause is not in this log."), confirm="the log of the first rank to fail (an OOM or "
            "SIGKILL there is the cause), sacct MaxRSS/State of every node, and NCCL_DEBUG=INFO for the network")
    kill = _first(events, "launcher_kill")
    if kill and not exc:
        code = _launcher_return_code(log, kill.index)
        if code in (None, -9, 137):
            return kill, Verdict("host_oom", _host_used(log, kill.index), rank=kill.rank, cause="sigkill",
                                 confidence="medium", confirm=SIGKILL_CONFIRM, reason=(
                                     "The DeepSpeed launcher killed its subprocesses after one died with no error of "
                                     "its own in the log: almost always the kernel's out-of-memory kill (host memory)."))
        return kill, Verdict("unknown", rank=kill.rank, cause="exit_code_only", confidence="low", reason=(
            f"A subprocess exited with code {code} and the launcher killed the rest; the cause is not in the log."),
            confirm="the failing rank's own output")
    if exc:
        if _in_teardown(log, exc.index):
            return exc, Verdict("not_oom", rank=exc.rank, cause="teardown", phase="teardown", reason=(
                f"The process failed in teardown{_on(exc.rank)} ({exc.detail}): while shutting down after its work."))
        return exc, _not_oom(exc.kind, exc.rank, cause="python_error")
    down = _teardown_frame(log)
    if down is not None:
        return None, Verdict("not_oom", cause="teardown", phase="teardown", reason=(
            "The process failed in teardown (destroy_process_group): while shutting down after its work."))
    said = f" (the scheduler recorded {_describe_record(rec)})" if _describe_record(rec) else ""
    bare = _bare_ending(log)
    if bare:
        return None, Verdict("unknown", cause=bare, confidence="low", reason=(
            f"{_BARE_REASON[bare]}; the cause is not in the log{said}."), confirm="the failing rank's own output "
            "(torchrun --tee 3, or @record on the entry point) and sacct -j JOBID -o JobID,State,ExitCode,MaxRSS,ReqMem")
    return None, Verdict("unknown", reason=f"No recognisable failure signature in the log{said}.",
                         confidence="low", confirm="sacct -j JOBID -o JobID,State,ExitCode,MaxRSS,ReqMem and every "
                         "rank's own log")


def _root_cause_exit(log: _Log, i: int, rank: int | None) -> int | str | None:
    """torchrun's "Root Cause (first observed failure)" block after line ``i``: its exit code, or "another rank"
    when it names a rank other than ``rank``; None when there is no such block."""
    for j in range(i, min(len(log), i + 80)):
        if _ROOT_CAUSE.search(log.raw[j]):
            for k in range(j + 1, min(len(log), j + 10)):
                m = _SUMMARY_RANK.match(log.body(k))
                if m and rank is not None and int(m.group(1)) != rank:
                    return "another rank"
                m = _EXITCODE.match(log.body(k))
                if m:
                    return int(m.group(1))
            return None
    return None


def _launcher_return_code(log: _Log, i: int) -> int | None:
    for j in range(i, min(len(log), i + 20)):
        m = _RETURN_CODE.search(log.raw[j])
        if m:
            return int(m.group(1))
    return None


def _host_used(log: _Log, i: int) -> dict:
    """Host memory in use stated just before a kill (a DeepSpeed or monitor line), as {host_used_mib}."""
    for j in range(i, max(-1, i - 20), -1):
        m = _HOST_USED.search(log.raw[j])
        if m:
            size = _stated_mib(m.group(1))
            return {"host_used_mib": size} if size else {}
    return {}


def _teardown_frame(log: _Log) -> int | None:
    """A traceback frame in destroy_process_group (the last 200 lines)."""
    for j in range(len(log) - 1, max(-1, len(log) - 200), -1):
        if re.search(r"\bin destroy_process_group\b", log.raw[j]):
            return j
    return None


_BARE_REASON = {"child_failed_bare": "torchrun reported a failed rank (ChildFailedError) with no error of its own",
                "exit_code_only": "A process exited with a non-zero code and nothing else"}
_EXIT_LINE = re.compile(r"exitcode\s*:\s*-?[1-9]|exit(?:ed with)? (?:code|status) -?[1-9]|return code = -?[1-9]|"
                        r"returncode[ =:]+-?[1-9]")


def _bare_ending(log: _Log) -> str | None:
    """What a log with no failure signature still shows at its end: a ChildFailedError summary, an exit code."""
    tail = range(max(0, len(log) - 300), len(log))
    if any("ChildFailedError" in log.raw[j] for j in tail):
        return "child_failed_bare"
    if any(_EXIT_LINE.search(log.raw[j]) for j in tail):
        return "exit_code_only"
    return None


def _on(rank: int | None) -> str:
    return f" on rank {rank}" if rank is not None else ""


_WHAT = re.compile(r"^\s*what\(\):")


def _abort_told(log: _Log, events: list, abort: _Event) -> _Event | None:
    """The not-OOM event on an abort's own ``what():`` line, if any: C++'s terminate prints the uncaught
    exception's message on the line after "terminate called after throwing an instance of ..." (c10d's watchdog
    ends a job this way, its timeout stated only there)."""
    j = abort.index + 1
    if j >= len(log) or not _WHAT.match(log.body(j)):
        return None
    return next((e for e in events if e.index == j and e.group == "not_oom"), None)


_BAR_DONE = re.compile(r"(?:^|\r)([^\r|]*?)\b100%\|[^|]*\|\s*(\d+)/(\2)\b")
"""A tqdm bar at its end ("Train: 100%|####| 74/74 [...]"): its description and the count."""
_NOT_TRAINING = re.compile(r"[Ee]val|[Vv]alid|[Tt]est|[Pp]redict|[Ii]nfer|[Ss]ampl|[Gg]enerat")


def _bar_done(line: str) -> bool:
    """Whether ``line`` shows a training progress bar at 100 % (not a loading, preprocessing or evaluation bar)."""
    return any(not _NOT_STEPS.search(m.group(1)) and not _NOT_TRAINING.search(m.group(1))
               for m in _BAR_DONE.finditer(line))


_BAR_COUNT = re.compile(r"(?<![\d/])(\d+)/(\d+) \[")
"""A tqdm count ("  12/1000 ["): the step and the total."""


def _completed_before(log: _Log, i: int) -> int | None:
    """The last line before ``i`` saying training completed, if any: a line of ``_COMPLETED``, or a training
    progress bar at 100 % that is the last progress line before ``i`` and counts the longest loop of the window
    (an epoch's bar followed by the next epoch's, or an evaluation bar inside a longer training bar, is not the
    end of training)."""
    bar, totals = None, []
    for j in range(i - 1, max(-1, i - 400), -1):
        raw = log.raw[j]
        if _COMPLETED.search(raw):
            return j
        counts = [(int(m.group(1)), int(m.group(2))) for m in _BAR_COUNT.finditer(raw)]
        if bar is None and not totals and "100%|" in raw and _bar_done(raw):
            bar = j
        totals += [total for _step, total in counts]
    if bar is None:
        return None
    done = [int(m.group(2)) for m in _BAR_DONE.finditer(log.raw[bar])]
    return bar if done and max(done) >= max(totals, default=0) else None


def _exit_frames_near(log: _Log, i: int) -> bool:
    """Whether the crash's backtrace (the lines after it) runs through the interpreter's exit handlers."""
    return any(_EXIT_FRAMES.search(log.raw[j]) for j in range(i, min(len(log), i + 30)))


def _in_teardown(log: _Log, i: int) -> bool:
    frames = _traceback_lines(log, i)
    return bool(frames) and any("destroy_process_group" in log.raw[j] for j in frames)


def _not_oom(label: str, rank: int | None, note: str = "", cause: str | None = None) -> Verdict:
    where = f" on rank {rank}" if rank is not None else ""
    tail = f" ({note})" if note else ""
    cause = cause or _CAUSES.get(label) or ("cudnn_not_supported" if "CUDNN_STATUS_NOT_SUPPORTED" in label else
                                            "python_error")
    return Verdict("not_oom", rank=rank, reason=f"Not an out-of-memory failure{where}: {label}{tail}.", cause=cause)


def _oom_verdict(event: _Event, rec: JobRecord) -> Verdict:
    numbers = dict(event.numbers)
    where = (f" on GPU {event.gpu}" if event.gpu is not None else "") + (
        f" (rank {event.rank})" if event.rank is not None else ""
    )
    reason = _OOM_REASONS[event.kind](event, numbers, where)
    if rec.state and rec.state not in ("FAILED", "OUT_OF_MEMORY"):
        reason = reason[:-1] + f", although the scheduler recorded {rec.state}."
    return Verdict(event.kind, numbers, event.gpu, event.rank, reason=reason, cause=event.cause,
                   confidence=event.confidence, confirm=event.confirm)


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
    if _capped_free_mib(n) is not None:
        reserved = _reserved_mib(n)
        held = (f"the cache's {_fmt_mib(reserved)}" if reserved is not None else
                f"this process's {_fmt_mib(n['process_in_use_mib'])} (its CUDA context with it)"
                if "process_in_use_mib" in n else "this process")
        parts.append(f"-- but a memory-fraction cap allowed {_fmt_mib(n['allowed_mib'])}, which {held} and the "
                     "request passed")
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


# --------------------------------------------------------------------------- where and when

_FRAME = re.compile(r'^\s*File "([^"]*)", line \d+, in (\S+)')
# (phase, pattern on a frame's function name, code line or path); the first phase any frame shows wins, so an
# evaluation's forward is eval and a checkpoint's clone() is checkpoint.
_PHASE_FRAMES = (
    ("teardown", re.compile(r"destroy_process_group|__run_exit_handlers|_exit_function")),
    ("data", re.compile(r"\bin _worker_loop\b")),  # anything inside a DataLoader worker
    ("checkpoint", re.compile(r"\bin _?save\w*|save_checkpoint|save_model|save_pretrained|torch\.save\(|"
                              r"\bin _?(?:full_|sharded_)?state_dict\b|consolidate_state_dict")),
    ("eval", re.compile(r"\bin (?:evaluate|_?evaluation_loop|prediction_step|prediction_loop|predict|"
                        r"_run_evaluation|validation_step|validate|_?eval\w*|test_step|_run_eval\w*)\b|"
                        r"\bevaluation_loop\(|\.evaluate\(")),
    ("generate", re.compile(r"\bin (?:generate|_?sample|greedy_search|beam_search|_?generate\w*)\b|\.generate\(")),
    ("load", re.compile(r"\bin (?:from_pretrained|_?load_state_dict\w*|load_checkpoint|_?load_from\w*|_apply|"
                        r"_load\w*|load|_broadcast_model|_materialize\w*|to_empty|_move_model_to_device)\b|"
                        r"\b(?:from_pretrained|load_state_dict|load_checkpoint|_broadcast_model|to_empty)\(|torch\.load\(")),
    ("optimizer", re.compile(r"torch/optim/|\bin (?:_single_tensor_\w+|_multi_tensor_\w+|_fused_\w+|"
                             r"optimizer_step|_optimizer_step)\b|optimizer\.step\(|\bin step\b.*optim")),
    ("backward", re.compile(r"\bin (?:backward|run_backward|_engine_run_backward)\b|\.backward\(|autograd/")),
    ("data", re.compile(r"\bin (?:_worker_loop|_next_data|__next__|fetch|collate\w*|_process_data)\b|"
                        r"torch/utils/data/")),
    ("forward", re.compile(r"\bin (?:forward|_call_impl|_wrapped_call_impl|training_step|_forward\w*)\b")),
)
# Phase from the failing line itself when there is no traceback: a DataLoader worker's message, a logger line
# that names it, a checkpoint-loading progress bar ended by the kill.
_LINE_PHASE = (
    ("data", re.compile(r"DataLoader worker|in worker\b|insufficient shared memory \(shm\)")),
    ("checkpoint", re.compile(r"Failed to clone\(\) tensor|returning from state_dict\(\) call")),
    ("eval", re.compile(r"\bduring eval(?:uation)?\b")),
    ("load", re.compile(r"Loading checkpoint shards")),
)
# Progress lines: (regex giving step and total). The last one before the failure is the step.
_PROGRESS = (
    re.compile(r"(?<![\d/])(\d+)/(\d+) \["),  # tqdm: "  12/1000 [00:10<..."
    re.compile(r"\[\d+\]\[\s*(\d+)/(\d+)\]"),  # "Epoch: [1][10003/10010]"
    re.compile(r"\b[Ss]tep[:= ]\s*(\d+)\s*/\s*(\d+)\b"),  # "Step 85700/300000"
    re.compile(r"(?<![\d/])(\d+)/(\d+) samples\b"),
    re.compile(r"(?<![_\w])step (\d+)()\b(?!\s*/|\.(?:batch|extern|\d))"),  # "during step 1", not a Slurm step id
)
_NOT_STEPS = re.compile(r"Loading|Map\b|Filter|[Tt]okeniz|Download|Generating|Preprocess|Fetching|Extract|"
                        r"Resolving|Converting|shards|Saving|Prepar")
"""A progress bar whose description names loading or preprocessing is not a training step."""
_SCHEDULER_LINES = ("slurmstepd", "srun:", "sbatch:", "salloc:")
"""Lines of the scheduler's own, whose "step" is a Slurm job step (``step 59137890.batch``), not a training step."""
PROGRESS_WINDOW = 600
"""Lines before the failure searched for its last progress line."""


def _where_when(verdict: Verdict, event: _Event | None, log: _Log) -> Verdict:
    """Fill ``phase`` (from the failing traceback, else the failing line) and ``step``/``total_steps``."""
    if event is None:  # the record decided, or nothing did: the last progress line of the log
        step, total = _step(log, len(log) - 1)
        return replace(verdict, step=step, total_steps=total)
    phase = verdict.phase or _phase(log, event)
    step, total = _step(log, event.index)
    return replace(verdict, phase=phase, step=step, total_steps=total)


def _traceback_lines(log: _Log, i: int) -> list[int]:
    """Indices of the frame lines of the traceback that ends at line ``i`` (same rank), or that follows it
    (a THC check or a logger line printed before the traceback); [] when there is none."""
    rank = log.rank(i)
    start = None
    for j in range(i, max(-1, i - TRACEBACK_WINDOW), -1):
        if "Traceback (most recent call last)" in log.raw[j] and (rank is None or log.rank(j) in (None, rank)):
            start = j
            break
    end = i
    if start is None:  # frames logged without their header (a logger's traceback) just above the line
        block = []
        for j in range(i - 1, max(-1, i - 100), -1):
            if 'File "' in log.raw[j] or (j + 1 < i and 'File "' in log.raw[j - 1] if j > 0 else False):
                block.append(j)
            elif block or j < i - 2:
                break
        if any('File "' in log.raw[j] for j in block):
            return sorted(block)
    if start is None:
        for j in range(i + 1, min(len(log), i + 60)):
            if "Traceback (most recent call last)" in log.raw[j]:
                start = j
                break
        if start is None:
            return []
        end = next((k for k in range(start + 1, min(len(log), start + TRACEBACK_WINDOW))
                    if _EXCEPTION.match(log.body(k))), min(len(log), start + TRACEBACK_WINDOW))
    return [j for j in range(start + 1, end) if rank is None or log.rank(j) in (None, rank)]


def _phase(log: _Log, event: _Event) -> str | None:
    if _LINE_PHASE[0][1].search(log.body(event.index)):
        return "data"  # the failing line itself is a DataLoader worker's
    frames = _traceback_lines(log, event.index)
    text = "\n".join(log.body(j) for j in frames)
    if frames:
        for phase, pattern in _PHASE_FRAMES:
            if pattern.search(text):
                return phase
    near = " ".join(log.body(j) for j in range(max(0, event.index - 1), event.index + 1))
    for phase, pattern in _LINE_PHASE:
        if pattern.search(near if phase == "load" else log.body(event.index)):
            return phase
    return None


def _step(log: _Log, i: int) -> tuple[int | None, int | None]:
    """(step, total) from the last progress line at or before line ``i``; (None, None) when none says it."""
    for j in range(i, max(-1, i - PROGRESS_WINDOW), -1):
        body = log.body(j)
        if not any(c.isdigit() for c in body) or "Traceback" in body or body.startswith(_SCHEDULER_LINES):
            continue
        best = None
        for pattern in _PROGRESS:
            for m in pattern.finditer(body):
                if _NOT_STEPS.search(body[max(0, m.start() - 400):m.start()]):
                    continue
                if best is None or m.start() > best.start():
                    best = m
        if best is not None:
            total = int(best.group(2)) if best.group(2) else None
            return int(best.group(1)), total
    return None, None


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


_RANK_KIND = {"fault": "not_oom", "not_oom": "not_oom", "exception": "not_oom", "sigkill": "host_oom",
              "launcher_kill": "unknown",
              "ambiguous": "unknown", "segfault": "not_oom", "abort": "unknown",
              "peer": "unknown"}


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
    if verdict.deepspeed_version is None:  # the engine names its version at start-up: in a skipped head
        heads = (read_head(p, HEAD_BYTES) for p, tail in zip(paths, tails) if tail.truncated and tail.first_line != 1)
        verdict = replace(verdict, deepspeed_version=next(filter(None, map(deepspeed_version, heads)), None))
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
