"""Literal CUDA out-of-memory messages for tests, in PyTorch's own wording (shared by the triage tests)."""


def new_oom(tried, total, free, in_use, allocated, unallocated, other=None):
    """A PyTorch >= 2.1 caching-allocator message (sizes in GiB)."""
    procs = f"Process 4242 has {other:.2f} GiB memory in use. " if other else ""
    return (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {tried:.2f} GiB. GPU 0 has a total capacity "
        f"of {total:.2f} GiB of which {free:.2f} GiB is free. {procs}Including non-PyTorch memory, this process has "
        f"{in_use:.2f} GiB memory in use. Of the allocated memory {allocated:.2f} GiB is allocated by PyTorch, and "
        f"{unallocated:.2f} GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
        "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
    )
