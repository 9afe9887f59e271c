"""The real caching allocator's own record of a CUDA run, set against the allocator model (issue 11, item 6).

On a GPU, ``torch.cuda.memory._record_memory_history()`` makes the allocator log every event, and
``torch.cuda.memory._snapshot()`` returns them (``device_traces``, one list per device; format: the docstring of
``torch.cuda.memory._snapshot``, torch 2.x; ``toolkit/triage/snapshot.py`` reads the same dicts from files):

- ``alloc`` / ``free_requested`` / ``free_completed`` of a block (``addr``, ``size``: the bytes asked for, before
  rounding); a free is requested when the tensor dies and completed when the block is back in its pool, which is
  later for a block used on another stream (``record_stream``): the pool sees the completion;
- ``segment_alloc`` / ``segment_free`` (``cudaMalloc`` / ``cudaFree`` of a segment; ``segment_map`` /
  ``segment_unmap`` with expandable segments): what the card really reserved;
- ``oom``, ``snapshot``: markers.

``events_from_trace`` turns the block events into the ``("alloc", id, nbytes[, stream])`` / ``("free", id)`` stream that
``allocator.replay`` takes, with ``("defer", id)`` / ``("return", id)`` for a free whose completion waited (a block
freed whose alloc the trace does not hold, because recording started after it, is left out); ``reserved_from_trace`` follows the segment events to the real reserved bytes and segment count at
their peak; ``compare`` replays the stream through the model under the same allocator settings and puts the two
side by side. Pure functions on plain data: no torch, no GPU (``benchmarks/gpu_replay.py`` makes the record on one).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from ..errors import ConfigError
from .allocator import parse_alloc_conf, replay

_MAPS = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def _entries(trace: Any) -> Iterable[Mapping[str, Any]]:
    if not isinstance(trace, Sequence) or isinstance(trace, (str, bytes)):
        raise ConfigError(f"device trace: expected a list of events, got {type(trace).__name__}")
    for i, entry in enumerate(trace):
        if not isinstance(entry, Mapping) or not isinstance(entry.get("action"), str):
            raise ConfigError(f"device trace event {i}: expected a dict with an 'action', got {str(entry)[:80]}")
        if entry["action"] in ("alloc", "free_completed", *_MAPS):
            for key in ("addr", "size"):
                value = entry.get(key)
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ConfigError(f"device trace event {i} ({entry['action']}): {key} must be a "
                                      f"non-negative integer, got {value!r}"[:200])
        yield entry


def events_from_trace(trace: Sequence[Mapping[str, Any]]) -> list[tuple]:
    """The block events of one device's trace as the allocator model's stream, in the pool's order (a block
    returns to its pool at ``free_completed``). A free requested and completed at once is a ``free``; one whose
    completion comes later (``record_stream``: its event had not completed) is a ``defer`` at the request and a
    ``return`` at the completion, so the model's allocated bytes drop where ``max_memory_allocated``'s do."""
    out: list[tuple] = []
    live: dict[int, int] = {}  # address -> id of the block allocated there
    waiting: set[int] = set()  # addresses whose free was requested, not yet completed
    next_id = 0
    entries = list(_entries(trace))
    for n, entry in enumerate(entries):
        action = entry["action"]
        if action == "free_requested":
            addr = entry.get("addr")
            then = entries[n + 1] if n + 1 < len(entries) else {}
            if addr in live and addr not in waiting and not (then.get("action") == "free_completed"
                                                            and then.get("addr") == addr):
                waiting.add(addr)
                out.append(("defer", live[addr]))
            continue
        if action == "alloc":
            live[entry["addr"]] = next_id
            # the CUDA stream's handle (0: the default stream): the allocator serves each stream from its own blocks
            stream = entry.get("stream", 0)
            size = max(1, entry["size"])
            out.append(("alloc", next_id, size, stream) if isinstance(stream, int) and stream
                       else ("alloc", next_id, size))
            next_id += 1
        elif action == "free_completed":
            i = live.pop(entry["addr"], None)
            if i is not None:
                out.append(("return", i) if entry["addr"] in waiting else ("free", i))
                waiting.discard(entry["addr"])
    return out


def reserved_from_trace(trace: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """What the card reserved per the trace's segment events: the peak bytes (over the record, counted from what
    was reserved when it started: 0 if recording began on a fresh process), the segments alive then, and at
    the end."""
    reserved = peak = segments = peak_segments = 0
    for entry in _entries(trace):
        sign = _MAPS.get(entry["action"])
        if sign is None:
            continue
        reserved += sign * entry["size"]
        if entry["action"] in ("segment_alloc", "segment_free"):
            segments += sign
        if reserved > peak:
            peak, peak_segments = reserved, segments
    return {"peak_reserved": peak, "segments_at_peak": peak_segments, "reserved_end": reserved,
            "segments_end": segments}


def compare(trace: Sequence[Mapping[str, Any]], alloc_conf: str = "", capacity: int | None = None) -> dict[str, Any]:
    """The model's replay of the recorded stream beside what the real allocator reserved (bytes; ``error`` is
    (model - real) / real of the reserved peak, None when the record holds no segment events)."""
    events = events_from_trace(trace)
    real = reserved_from_trace(trace)
    model = replay(events, capacity, parse_alloc_conf(alloc_conf))
    err = (model.peak_reserved - real["peak_reserved"]) / real["peak_reserved"] if real["peak_reserved"] else None
    return {"events": len(events), "alloc_conf": alloc_conf,
            "real": real,
            "model": {"peak_allocated": model.peak_allocated, "peak_reserved": model.peak_reserved,
                      "segments_at_peak": model.segments, "reserved_end": model.reserved_end,
                      "fragmentation": model.fragmentation, "oom": model.oom is not None},
            "error": err}
