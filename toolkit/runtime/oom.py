"""Rehearse a genuine out-of-memory failure (``python -m toolkit.train --oom-at-step N``).

From step N on, the chosen rank(s) really allocate memory past the limit the job runs under, so what ends the
job is the real mechanism, never an exception raised here: on a GPU the CUDA caching allocator's
``OutOfMemoryError``; on a CPU node the cgroup's OOM killer (Slurm ``--mem``) or, under an address-space cap
(the local backend's RLIMIT_AS), the CPU allocator's own error. Host memory is touched page by page so it is
resident, not just reserved.

Two kinds:
  activations  ``mib_per_sample x micro_batch`` held from the start of each forward to the end of its backward,
               like activations: a smaller micro-batch (with more accumulation) can answer it.
  fixed        one block held from step N on, whatever the micro-batch: only more memory (or offload) answers it.

The amount: ``--oom-mib`` (per sample for activations, in all for fixed), else 110% of the limit this process
sees (``limit_bytes``), per sample divided by the micro-batch of the first step that allocates. Give
``--oom-mib`` when a retry should get past step N with a move (a limit-based amount follows the new limit).
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

MIB = 2**20
CHUNK_BYTES = 64 * MIB
OVER = 1.10


def cgroup_limit_bytes(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The tightest memory limit of this process's cgroup and its ancestors (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``); None when there is none."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    limits: list[int] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # v2
            base, name = Path(root), "memory.max"
        elif "memory" in controllers.split(","):
            base, name = Path(root) / "memory", "memory.limit_in_bytes"
        else:
            continue
        path = base / rel.lstrip("/")
        while True:
            try:
                text = (path / name).read_text().strip()
                if text.isdigit() and int(text) < 2**60:
                    limits.append(int(text))
            except OSError:
                pass
            if path == base or path.parent == path:
                break
            path = path.parent
    return min(limits) if limits else None


def host_limit_bytes() -> int:
    """What host memory this process may use: the cgroup limit, the address-space cap, the machine's RAM."""
    options = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    cg = cgroup_limit_bytes()
    if cg:
        options.append(cg)
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft not in (resource.RLIM_INFINITY, -1) and soft > 0:
        options.append(soft)
    return min(options)


def limit_bytes(device) -> int:
    """The memory limit the rehearsal must pass: the GPU's (with the partition's cap) or the host's."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)  # the card's, whatever cap the allocator has
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.5
        if fraction is not None:
            return int(total * fraction(device.index if device.index is not None else torch.cuda.current_device()))
        return int(total)
    return host_limit_bytes()


class OomRehearsal:
    """Allocates past the limit from ``at_step`` on (``rank``: only that rank; None: every rank)."""

    def __init__(self, at_step: int, *, kind: str = "activations", rank: int | None = None, mib: float | None = None,
                 my_rank: int = 0, device=None):
        self.at_step, self.kind, self.rank, self.mib = at_step, kind, rank, mib
        self.my_rank, self.device = my_rank, device
        self.per_sample_bytes: int | None = None
        self.held: list = []
        self.fixed_done = False

    def active(self, step: int) -> bool:
        return step >= self.at_step and (self.rank is None or self.rank == self.my_rank)

    def amount(self, micro_batch: int) -> int:
        """Bytes to hold for one micro-batch of ``micro_batch`` samples (fixed: in all)."""
        if self.kind == "fixed":
            return int(self.mib * MIB) if self.mib else int(OVER * limit_bytes(self.device))
        if self.per_sample_bytes is None:
            self.per_sample_bytes = int(self.mib * MIB) if self.mib else int(OVER * limit_bytes(self.device)
                                                                              / max(1, micro_batch))
        return self.per_sample_bytes * micro_batch

    def before_micro(self, step: int, micro_batch: int) -> None:
        """Call before each forward: allocates (and keeps) what this step's rehearsal holds."""
        if not self.active(step):
            return
        if self.kind == "fixed":
            if not self.fixed_done:
                self._allocate(self.amount(micro_batch))
                self.fixed_done = True
            return
        self._allocate(self.amount(micro_batch))

    def after_micro(self) -> None:
        """Call after each backward: activations are freed."""
        if self.kind != "fixed":
            self.held.clear()

    def _allocate(self, total: int) -> None:
        import torch

        print(f"hpcmem: --oom-at-step {self.at_step} ({self.kind}): rank {self.my_rank} allocating "
              f"{total / MIB:.0f} MiB", flush=True)
        device = self.device if self.device is not None else torch.device("cpu")
        left = total
        while left > 0:
            n = min(CHUNK_BYTES, left)
            block = torch.empty(n, dtype=torch.uint8, device=device)
            block.fill_(1)  # touch every page: resident, as the OOM killer counts it
            self.held.append(block)
            left -= n
