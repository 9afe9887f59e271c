"""What a CUDA device is, asked the same way on both sides (a shared leaf: docs/architecture.md).

``visible_nvml_handle``: NVML's handle for a CUDA device index as ``CUDA_VISIBLE_DEVICES`` numbers it (the job's
monitor and the login side's calibration probe). ``nvml_used_bytes``: device memory in use as nvidia-smi shows it.
``gpu_has_bf16``: bf16 the card really has (not V100's emulation).
"""

from __future__ import annotations

import os


def visible_nvml_handle(pynvml, cuda_index: int, environ=None):
    """NVML's handle for CUDA device ``cuda_index`` as CUDA_VISIBLE_DEVICES numbers them (an NVML index, or a
    GPU-/MIG- UUID there), without asking CUDA: NVML numbers every device on the node."""
    visible = [v.strip() for v in (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES", "")
               .split(",") if v.strip()]
    entry = visible[cuda_index] if cuda_index < len(visible) else None
    if entry is not None and entry.startswith(("GPU-", "MIG-")):
        return pynvml.nvmlDeviceGetHandleByUUID(entry)
    return pynvml.nvmlDeviceGetHandleByIndex(int(entry) if entry is not None and entry.isdigit() else cuda_index)


def nvml_used_bytes(pynvml, handle, pid: int | None = None) -> int:
    """Device memory in use as nvidia-smi shows it: process ``pid``'s own where NVML lists it (a GPU shared with
    other jobs), else the device's, without the memory the driver reserves for itself.

    NVML's first ``nvmlDeviceGetMemoryInfo`` counts that reservation as used: on an H100 80GB with driver 580 it is
    about 480 MiB (nvidia-smi's total 81,559 MiB against CUDA's 81,079), there before any process runs, which the
    ``_v2`` call (driver >= 510) reports apart as ``reserved`` (benchmarks/results/gpu-session-20261127.txt)."""
    own = nvml_process_used_bytes(pynvml, handle, pid) if pid is not None else None
    if own is not None:
        return own
    version = getattr(pynvml, "nvmlMemory_v2", None)
    if version is not None:
        try:
            return pynvml.nvmlDeviceGetMemoryInfo(handle, version=version).used
        except Exception:  # noqa: BLE001 - a driver before 510 or a pynvml without the version argument
            pass
    return pynvml.nvmlDeviceGetMemoryInfo(handle).used


def nvml_process_used_bytes(pynvml, handle, pid: int) -> int | None:
    """Process ``pid``'s device memory as NVML lists it; None where it is not listed (no CUDA context yet, a
    container's own pid space, a driver that cannot tell)."""
    try:
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == pid and isinstance(process.usedGpuMemory, int):
                return process.usedGpuMemory
    except Exception:  # noqa: BLE001 - an old driver or pynvml: not listed
        pass
    return None


def gpu_has_bf16(torch) -> bool:
    """Whether the current CUDA device computes in bf16: torch >= 2.3 counts V100's slow emulation as support
    unless told not to."""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:
        return torch.cuda.is_bf16_supported()
