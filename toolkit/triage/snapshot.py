"""The CUDA allocator snapshot a job wrote on an out-of-memory error: what held the memory, and who allocated it.

The runtime (``toolkit/runtime/monitor.py``) keeps ``torch.cuda.memory._record_memory_history`` on and, on an
OOM, writes ``torch.cuda.memory._dump_snapshot`` to ``<attempt_dir>/memory-snapshot-rank<r>.pickle``. The file
opens at https://pytorch.org/memory_viz; this module reads it without torch (no GPU needed).

Format (``torch.cuda.memory._snapshot``'s docstring, torch 2.x): a dict with ``segments`` (each a cudaMalloc'd
region: ``device``, ``address``, ``total_size``, ``allocated_size``, ``active_size``, ``blocks``) and
``device_traces`` (per device, the recorded allocator events: ``action`` alloc / free_requested /
free_completed / segment_alloc / segment_free / oom / snapshot, ``addr``, ``size``, ``frames``, and for ``oom``
``device_free``). A block has ``size``, ``requested_size``, ``address``, ``state`` (``active_allocated``: a live
tensor; ``active_awaiting_free``; ``inactive``: cached) and ``frames`` [{filename, line, name}], innermost first.

``summarise(data)`` is pure (a dict in, a dict out); ``read_snapshot(path)`` loads the pickle with an unpickler
that admits only plain containers and numbers (a snapshot holds nothing else), so a hostile file cannot run code.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any, Mapping

from ..errors import HpcmemError

VIEWER = "https://pytorch.org/memory_viz"
SNAPSHOT_GLOB = "memory-snapshot-rank*.pickle"
MAX_SNAPSHOT_BYTES = 512 * 2**20
"""A larger file is not read (torch's own snapshots with HISTORY_MAX_ENTRIES events are far smaller)."""
LIVE = "active_allocated"
MIB = 2**20
# Frames of the allocator and of torch's own machinery say nothing about which code allocated.
_NOISE = ("torch/cuda/memory.py", "torch/utils/_", "CUDACachingAllocator", "??", "<unknown>")


class SnapshotError(HpcmemError):
    """A snapshot file that cannot be read (not a pickle, not a snapshot, too large)."""


def read_snapshot(path: str | Path) -> dict[str, Any]:
    """The snapshot dict of ``path`` (plain data only); SnapshotError with one line when it is not one."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_SNAPSHOT_BYTES:
            raise SnapshotError(f"{path}: {size / MIB:.0f} MiB is larger than the {MAX_SNAPSHOT_BYTES // MIB} MiB "
                                "read here; open it at " + VIEWER)
        data = _PlainUnpickler(io.BytesIO(path.read_bytes())).load()
    except SnapshotError:
        raise
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file
        raise SnapshotError(f"{path}: not a readable allocator snapshot ({type(exc).__name__}: "
                            f"{str(exc)[:120]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list):
        raise SnapshotError(f"{path}: not an allocator snapshot (no 'segments' list)")
    return data


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):  # noqa: D401 - a snapshot has no classes
        raise pickle.UnpicklingError(f"refusing {module}.{name}: a snapshot holds plain data only")


def summarise(data: Mapping[str, Any], top: int = 5, stack_depth: int = 6) -> dict[str, Any]:
    """What the snapshot says, MiB: reserved (segments), allocated (live blocks), the ``top`` largest live
    tensors each with the stack that allocated it (the ``stack_depth`` innermost frames of user code), and the
    OOM event when the trace recorded one ({size_mib, device_free_mib, stack})."""
    segments = [s for s in data.get("segments") or [] if isinstance(s, Mapping)]
    live = []
    for seg in segments:
        for block in seg.get("blocks") or []:
            if isinstance(block, Mapping) and block.get("state") == LIVE and _num(block.get("size")):
                live.append(block)
    live.sort(key=lambda b: -b["size"])
    largest = [{"size_mib": round(b["size"] / MIB, 2),
                "requested_mib": round(b["requested_size"] / MIB, 2) if _num(b.get("requested_size")) else None,
                "address": b.get("address"), "stack": stack(b.get("frames"), stack_depth)} for b in live[:top]]
    by_site: dict[str, float] = {}
    for b in live:
        site = (stack(b.get("frames"), 1) or ["(no stack recorded)"])[0]
        by_site[site] = by_site.get(site, 0.0) + b["size"] / MIB
    sites = sorted(by_site.items(), key=lambda kv: -kv[1])[:top]
    return {
        "reserved_mib": round(sum(s["total_size"] for s in segments if _num(s.get("total_size"))) / MIB, 2),
        "allocated_mib": round(sum(b["size"] for b in live) / MIB, 2),
        "live_tensors": len(live),
        "largest": largest,
        "by_site": [{"site": s, "mib": round(m, 2)} for s, m in sites],
        "oom": _oom_event(data.get("device_traces"), stack_depth),
    }


def stack(frames: Any, depth: int) -> list[str]:
    """``file:line in name`` for the innermost ``depth`` frames that are not the allocator's own machinery."""
    out = []
    for frame in frames or []:
        if not isinstance(frame, Mapping):
            continue
        filename, name = str(frame.get("filename", "?")), str(frame.get("name", "?"))
        if any(n in filename or n in name for n in _NOISE):
            continue
        out.append(f"{filename}:{frame.get('line', '?')} in {name}")
        if len(out) >= depth:
            break
    return out


def _oom_event(traces: Any, depth: int) -> dict[str, Any] | None:
    for trace in traces or []:
        for event in reversed(trace or []):
            if isinstance(event, Mapping) and event.get("action") == "oom":
                free = event.get("device_free")
                return {"size_mib": round(event["size"] / MIB, 2) if _num(event.get("size")) else None,
                        "device_free_mib": round(free / MIB, 2) if _num(free) else None,
                        "stack": stack(event.get("frames"), depth)}
    return None


def find_snapshots(directory: str | Path) -> list[Path]:
    """The snapshot files an attempt directory holds, by rank."""
    return sorted(Path(directory).glob(SNAPSHOT_GLOB))


def describe(path: str | Path, top: int = 5) -> dict[str, Any]:
    """For triage: {path, viewer, summary or null, error or null} of one snapshot file."""
    try:
        return {"path": str(path), "viewer": VIEWER, "summary": summarise(read_snapshot(path), top), "error": None}
    except SnapshotError as exc:
        return {"path": str(path), "viewer": VIEWER, "summary": None, "error": str(exc)}


def _num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
