"""What a CUDA device is, asked the same way on both sides (a shared leaf: docs/architecture.md).

``visible_nvml_handle``: NVML's handle for a CUDA device index as ``CUDA_VISIBLE_DEVICES`` numbers it (the job's
monitor and the login side's calibration probe). ``gpu_has_bf16``: bf16 the card really has (not V100's emulation).
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


def gpu_has_bf16(torch) -> bool:
    """Whether the current CUDA device computes in bf16: torch >= 2.3 counts V100's slow emulation as support
    unless told not to."""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:
        return torch.cuda.is_bf16_supported()
