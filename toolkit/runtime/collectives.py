"""The rank collectives the job runtime agrees through: one home, below both the checkpointer and in-job
recovery (each imports it; neither imports the other for it).

Both are harmless without a process group: ``world_size()`` is 1 and ``any_rank(flag)`` is ``flag``."""

from __future__ import annotations


def world_size() -> int:
    """The process group's size, 1 without one (or without torch.distributed)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def any_rank(flag: bool, device=None) -> bool:
    """True when ``flag`` is true on any rank: the one collective that makes every rank take the same move (the
    flag itself without a process group). The flag travels on ``device``, else on the rank's current CUDA device
    under NCCL (which takes no CPU tensors), else on the CPU."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    if device is None:
        device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
