"""Memory estimates of one training step, per GPU and per node, before submission.

Two methods behind one interface (``estimate``):

- ``analytic`` (estimate/analytic.py): arithmetic from the model's shape, instant;
- ``traced`` (estimate/traced.py): one real training step of the actual model under
  PyTorch's fake tensors on the CPU, counting live tensor bytes without allocating them.

Both return an ``Estimate``: numbers in MiB, per GPU unless the name says per node.
The CLI formats them; nothing here prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

COMPONENTS = ("params", "grads", "optimizer", "activations", "temporaries", "cuda_context", "allocator_overhead")
"""Component names, in this order, in every Estimate (MiB per GPU)."""
METHODS = ("analytic", "traced")


@dataclass(frozen=True)
class Estimate:
    """A training step's memory (MiB) for one plan on one partition."""

    method: str
    components: Mapping[str, float]
    """MiB per GPU by COMPONENTS name."""
    peak_allocated_mib: float
    """Peak of live tensors, as ``torch.cuda.max_memory_allocated`` reports it."""
    device_used_mib: float
    """What nvidia-smi shows at peak: CUDA context + memory reserved by the caching allocator."""
    host_mib_per_node: float
    """Host memory per node the step needs beyond the processes themselves: offloaded states, pinned buffers."""
    capacity_mib: float
    """The partition's GPU memory (host memory on a CPU partition)."""
    headroom_mib: float
    """capacity - device_used (negative: does not fit)."""
    fits: bool
    notes: tuple[str, ...] = field(default_factory=tuple)
    """Assumptions and warnings worth telling a person (e.g. 'partition not calibrated')."""

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "components": dict(self.components),
                "peak_allocated_mib": self.peak_allocated_mib, "device_used_mib": self.device_used_mib,
                "host_mib_per_node": self.host_mib_per_node, "capacity_mib": self.capacity_mib,
                "fits": self.fits, "headroom_mib": self.headroom_mib, "notes": list(self.notes)}
