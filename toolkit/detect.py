"""What this machine has, for the ``local`` site: GPUs (pynvml), CPUs, memory."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Machine:
    gpu_model: str | None
    gpu_mem_gib: float
    gpus: int
    cpus: int
    host_mem_gib: float


@lru_cache(maxsize=1)
def local_machine() -> Machine:
    """Detect GPUs with NVML when it is there; otherwise a CPU machine."""
    model, mem_gib, count = _nvml_gpus()
    return Machine(gpu_model=model, gpu_mem_gib=mem_gib, gpus=count, cpus=_cpus(), host_mem_gib=_host_mem_gib())


def _nvml_gpus() -> tuple[str | None, float, int]:
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # no driver, no library, no GPU: a CPU machine
        return None, 0.0, 0
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return None, 0.0, 0
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else name
        total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
        return name, round(total / 2**30, 1), count
    finally:
        pynvml.nvmlShutdown()


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _host_mem_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return 0.0
