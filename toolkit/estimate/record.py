"""Record the real alloc/free stream of a fake-tensor training run, for the caching-allocator model.

``StorageRecorder`` is a TorchDispatchMode: after every operator it looks at the storages of the
outputs, and the first time it meets one it appends ``("alloc", id, nbytes)`` and registers a
finalizer that appends ``("free", id)`` when the storage goes away. Fake tensors have real
storages of the right size (no data), so the stream is the one the step makes, in its order,
tensor by tensor: the traced method replays it (``device.device_memory``).

Tensors made before the recorder starts (and not through an operator) are added with ``adopt``.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


class StorageRecorder(TorchDispatchMode):
    """The alloc/free events of every tensor storage made while it is active (and adopted ones)."""

    def __init__(self, round_to: int = 1):
        super().__init__()
        self.events: list[tuple] = []
        self._seen = WeakIdKeyDictionary()
        self._next = 0
        self.live = 0
        self.peak = 0
        self.round_to = round_to
        self._external: dict[int, int] = {}

    def _storage(self, st) -> None:
        if st in self._seen:
            return
        nbytes = int(st.nbytes())
        if nbytes <= 0:
            return
        self._next += 1
        sid = self._next
        self._seen[st] = sid
        self.events.append(("alloc", sid, nbytes))
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live
        weakref.finalize(st, self._free, sid, nbytes)

    def _free(self, sid: int, nbytes: int) -> None:
        self.events.append(("free", sid))
        self.live -= nbytes

    def adopt(self, tensors: Iterable[Any]) -> None:
        """Record tensors that exist already (made before the recorder started)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._storage(t.untyped_storage())

    def external(self, nbytes: int, stream: Any = 0) -> int:
        """An allocation made outside the dispatcher (a C++ component's own buffer, e.g. DDP's Reducer); its id,
        for ``release``. ``stream``: the allocator stream it belongs to (0: the default)."""
        self._next += 1
        self.events.append(("alloc", self._next, int(nbytes)) if stream == 0
                           else ("alloc", self._next, int(nbytes), stream))
        self._external[self._next] = int(nbytes)
        self.live += int(nbytes)
        self.peak = max(self.peak, self.live)
        return self._next

    def release(self, sid: int) -> None:
        """Free an ``external`` allocation (once: a second release of one id is a KeyError)."""
        self._free(sid, self._external.pop(sid))

    def mark(self, label: str) -> None:
        self.events.append(("mark", label))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat, _ = tree_flatten(out)
        for t in flat:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                try:
                    self._storage(t.untyped_storage())
                except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested)
                    pass
        return out

    def closed(self) -> list[tuple]:
        """The events, with storages still alive left allocated (what stays between steps)."""
        return list(self.events)
