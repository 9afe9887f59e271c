"""One table of failure kinds: what each verdict kind is, which memory it presses on, and what to do.

Every part of hpcmem that names a failure reads this table (issue 12): the classifier (``classify.KINDS``,
``OOM_KINDS``), the triage memory picture and report (``text``), ``--since`` grouping (``hint``), the remedies
(``family``), and the ladder and controller (``pressure``). A kind appears here once.

Columns
    kind      the verdict kind (``classify.Verdict.kind``)
    pressure  ``gpu`` (device memory), ``host`` (host RAM, cgroup, /dev/shm) or ``none`` (not a memory failure).
              ``nccl_oom`` is GPU memory except when its cause is ``shm`` (NCCL's /dev/shm segments are host
              memory): ask ``pressure_of(kind, cause)``, never the column alone.
    oom       whether it is an out-of-memory kind
    text      a few words for a person ("CUDA out of memory from fragmentation")
    hint      the direction for a group of such jobs when their plan is not known (``triage --since``)
    family    which remedies apply: ``gpu`` (the planner's memory moves), ``fragmentation`` (the allocator
              setting first, then the GPU moves), ``exclusive`` (the GPU to yourself; no plan move), ``host``
              (the ladder's host rungs), ``none`` (no memory advice: where to look instead)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FailureKind:
    kind: str
    pressure: str
    oom: bool
    text: str
    hint: str
    family: str


FAILURES: tuple[FailureKind, ...] = (
    FailureKind("gpu_oom", "gpu", True, "CUDA out of memory",
                "smaller micro-batch with more accumulation, then activation checkpointing (see triage JOBID)", "gpu"),
    FailureKind("gpu_oom_fragmentation", "gpu", True, "CUDA out of memory from fragmentation",
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "fragmentation"),
    FailureKind("gpu_oom_other_process", "gpu", True, "CUDA out of memory: another process holds the GPU",
                "another process holds the GPU: ask for it exclusively, check nvidia-smi on the node", "exclusive"),
    FailureKind("gpu_driver_oom", "gpu", True, "GPU memory ran out outside PyTorch's allocator",
                "leave room outside PyTorch's cache (cuBLAS/cuDNN workspaces, NCCL, the CUDA context): check "
                "nvidia-smi for another process on the GPU, then a smaller micro-batch or checkpointing", "gpu"),
    FailureKind("nccl_oom", "gpu", True, "NCCL ran out of memory",
                "NCCL buffers: more /dev/shm or GPU headroom (smaller micro-batch)", "gpu"),
    FailureKind("host_oom", "host", True, "Host memory ran out",
                "more --mem, fewer data-loader workers, or offload to NVMe instead of CPU; confirm a bare SIGKILL "
                "with sacct MaxRSS/State or dmesg", "host"),
    FailureKind("cpu_alloc_oom", "host", True, "Host memory ran out inside the process",
                "more --mem, fewer data-loader workers, or offload to NVMe instead of CPU", "host"),
    FailureKind("not_oom", "none", False, "Not an out-of-memory failure",
                "not a memory failure: read the cause on each job (triage JOBID says where to look)", "none"),
    FailureKind("unknown", "none", False, "The failure was not identified",
                "no failure signature: read the end of each log and sacct State/ExitCode/MaxRSS", "none"),
)

BY_KIND: dict[str, FailureKind] = {f.kind: f for f in FAILURES}
KINDS: tuple[str, ...] = tuple(f.kind for f in FAILURES)
OOM_KINDS: tuple[str, ...] = tuple(f.kind for f in FAILURES if f.oom)
GPU_KINDS: tuple[str, ...] = tuple(f.kind for f in FAILURES if f.oom and f.pressure == "gpu"
                                   and f.family != "exclusive")
"""GPU-memory kinds that memory moves can answer (not ``gpu_oom_other_process``: no move of ours helps)."""
HOST_KINDS: tuple[str, ...] = tuple(f.kind for f in FAILURES if f.oom and f.pressure == "host")
SHM_CAUSE = "shm"
"""The cause of an ``nccl_oom`` (or a DataLoader ``host_oom``) that ran out of /dev/shm: host memory."""
CONFIDENCES = ("high", "medium", "low")


def pressure_of(kind: str, cause: str | None = None) -> str:
    """``gpu``, ``host`` or ``none`` for a verdict's kind and cause (an nccl_oom about /dev/shm is host memory)."""
    if kind == "nccl_oom" and cause == SHM_CAUSE:
        return "host"
    return BY_KIND[kind].pressure if kind in BY_KIND else "none"


def is_host(verdict) -> bool:
    """Whether a verdict (anything with ``kind`` and ``cause``) is host-memory pressure: the host ladder applies.

    A verdict read back from an older ledger has no cause: an nccl_oom whose reason or evidence names /dev/shm is
    then the shared-memory one."""
    cause = getattr(verdict, "cause", None)
    if cause is None and verdict.kind == "nccl_oom":
        text = " ".join([getattr(verdict, "reason", ""), *(line for _, line in getattr(verdict, "evidence", ()))])
        cause = SHM_CAUSE if "/dev/shm" in text else None
    return pressure_of(verdict.kind, cause) == "host"


def text_of(kind: str) -> str:
    return BY_KIND[kind].text if kind in BY_KIND else kind


def hint_of(kind: str, cause: str | None = None) -> str:
    if kind == "nccl_oom" and cause == SHM_CAUSE:
        return "NCCL's /dev/shm segments: a larger /dev/shm (container --shm-size, or a node with more), NCCL_SHM_DISABLE=1"
    return BY_KIND[kind].hint if kind in BY_KIND else ""


def family_of(kind: str, cause: str | None = None) -> str:
    """The remedies family; an nccl_oom about /dev/shm takes the host rungs."""
    if pressure_of(kind, cause) == "host" and kind in OOM_KINDS:
        return "host"
    return BY_KIND[kind].family if kind in BY_KIND else "none"
