"""A model of PyTorch's CUDA caching allocator: replay an alloc/free stream, get what the GPU reserves.

The POLICY of ``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.x, the native backend), re-written
in Python from reading the source (no code copied). What it models, with the source's names:

- ``round_size``: requests round up to 512 B (``kMinBlockSize``); with ``roundup_power2_divisions``
  a request above 512 x divisions rounds up to the next of ``divisions`` equal steps between two
  powers of two (``roundup_power2_next_division``; divisions per power-of-two interval from 1 MiB
  to 64 GiB, 16 intervals).
- pools: a rounded request <= 1 MiB (``kSmallSize``) comes from the small pool, whose segments
  are 2 MiB (``kSmallBuffer``); larger ones from the large pool, whose new segments are 20 MiB
  (``kLargeBuffer``, ``large_segment_size_mb`` in the newest releases) for requests < 10 MiB
  (``kMinLargeAlloc``) and otherwise the request rounded up to 2 MiB (``kRoundLarge``)
  (``get_allocation_size``).
- streams: every block belongs to the stream that allocated it (``Block::stream``), and the pools
  order their free blocks by (stream, size, address), so a request is served only from its own
  stream's free blocks; a segment, split or merged, never changes stream. Expandable segments are
  one per pool and stream. ``release_available_cached_blocks`` frees only the request's stream's
  oversize segments; ``release_cached_blocks`` and the garbage collector free every stream's.
- ``get_free_block``: best fit, the smallest cached free block of the same pool and stream at least
  as large as the request, lowest address first among equals (segments get addresses from the top down, as
  ``cudaMalloc`` hands them out: the newest segment's block wins a tie; every record of the H100 session showed
  it, and only with it do all 12 replay to the card's reserved peak); never an
  oversize block (>= ``max_split_size``) for a request under it, nor, for a request above it, a
  block larger than the request + ``max_non_split_rounding_mb`` (default 20 MiB).
- ``should_split``: the block is split (the allocation at its front) when the remainder is
  >= 512 B in the small pool (and with expandable segments), > 1 MiB in the large pool, and
  never for a request >= ``max_split_size``. An unsplit block counts whole in "allocated"
  (``memory_allocated`` sums block sizes).
- ``free_block``: a freed block merges with free neighbours of its segment and returns to its pool.
- ``malloc``: free block -> (``garbage_collection_threshold``, only under a memory cap:
  ``set_per_process_memory_fraction``; here: a capacity) -> ``alloc_block`` (cudaMalloc of the
  segment size) -> ``release_available_cached_blocks`` (with ``max_split_size`` set: free oversize
  cached segments, largest first, until the request is covered) and retry -> ``release_cached_blocks``
  (every cached unsplit segment of both pools) and retry -> out of memory.
- ``expandable_segments:True``: one segment per pool, a virtual address range mapped in pages of
  the pool's segment size (2 MiB small, 20 MiB large: ``find_expandable_block`` builds
  ``ExpandableSegment(..., segment_size = is_small ? kSmallBuffer : kLargeBuffer)`` and ``map``
  rounds to it); a request no free block holds maps pages at the free end (the free block right
  before the unmapped range grows); best fit prefers blocks that do not need to grow; blocks split
  whenever the remainder is >= 512 B; on a failed map, free pages inside free blocks are unmapped
  and the map is retried. Reserved = mapped bytes.

Deferred frees (``record_stream``): a block used on another stream returns to its pool only when that
stream's event completes, which is a matter of timing the stream states. ``("defer", id)`` is the free the
program makes (``allocated`` drops, as ``max_memory_allocated`` sees it; the block stays out of its pool and
counts as active); ``("return", id)`` is the completion, when the block goes back to its pool. Before it
gives up, ``release_cached_blocks`` first calls ``synchronize_and_free_events`` (CUDACachingAllocator.cpp,
torch 2.x): every deferred block returns, then the cached segments are freed and the allocation retried, so
the deferred bytes are never what an out-of-memory error is short of (the placement they forced on requests
made meanwhile can still fragment the segments). A later
``return`` of a block that came back that way is a no-op. Not modelled: CUDA graphs' private pools, the
``cudaMallocAsync`` backend (its options are accepted and named in ``AllocatorConfig.unmodelled``),
pinned host memory options (irrelevant to device memory).

Input: an ordered stream of events, ``("alloc", id, nbytes)`` or ``("alloc", id, nbytes, stream)``
(stream: any hashable name; absent: 0, the default stream) / ``("free", id)`` (also ``"a"``/``"f"``) /
``("defer", id)`` and ``("return", id)`` (above) / ``("mark", label)``,
a capacity (bytes the allocator may reserve: the card minus context and non-PyTorch memory) or
None, and an ``AllocatorConfig`` (``parse_alloc_conf(PYTORCH_CUDA_ALLOC_CONF)``). Output: a frozen
``Replay``. Pure Python, no torch: a 100k-event stream replays in a fraction of a second.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, field
from itertools import islice
from typing import Iterable, Sequence

from ..errors import ConfigError

MIB = 1024 * 1024
K_MIN_BLOCK = 512                 # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 * MIB            # kSmallSize: largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 * MIB          # kSmallBuffer: "small" allocations are packed in 2 MiB blocks
K_LARGE_BUFFER = 20 * MIB         # kLargeBuffer: allocations between 1 and 10 MiB may use 20 MiB blocks
K_MIN_LARGE_ALLOC = 10 * MIB      # kMinLargeAlloc: allocations between 1 and 10 MiB may use kLargeBuffer
K_ROUND_LARGE = 2 * MIB           # kRoundLarge: round up large allocations to 2 MiB
ROUNDUP_INTERVALS = 16            # kRoundUpPowerOfTwoIntervals: 1 MiB .. 64 GiB
NO_LIMIT = (1 << 64) - 1          # max_split_size default: std::numeric_limits<size_t>::max()
_ADDRESS_SPACE = 1 << 52          # an expandable segment's virtual range (the card x 1.125 in torch): "enough"
_ADDR_BITS = 61                   # block addresses lie below 1 << 60 (``_new_segment`` counts down from there)
_ADDR_MASK = (1 << _ADDR_BITS) - 1

# Options CUDAAllocatorConfig::parseArgs accepts (torch 2.x); the modelled ones first.
_MODELLED = ("max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
             "roundup_power2_divisions", "expandable_segments", "large_segment_size_mb")
_ACCEPTED = ("backend", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
             "pinned_use_hip_host_register", "pinned_use_host_register", "pinned_num_register_threads",
             "pinned_use_background_threads", "pinned_reserve_segment_size_mb", "graph_capture_record_stream_reuse",
             "per_process_memory_fraction")


# -- settings ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AllocatorConfig:
    """The caching allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``), in bytes where sizes."""

    max_split_size: int = NO_LIMIT
    max_non_split_rounding: int = K_LARGE_BUFFER
    garbage_collection_threshold: float = 0.0
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    expandable_segments: bool = False
    large_segment_size: int = K_LARGE_BUFFER
    backend: str = "native"
    text: str = ""
    """the string it was parsed from"""
    unmodelled: tuple[str, ...] = ()
    """options accepted but without effect on device memory here"""

    def with_option(self, text: str) -> "AllocatorConfig":
        """These settings plus ``text`` (e.g. ``expandable_segments:True``), later options winning."""
        joined = ",".join(t for t in (self.text, text) if t)
        return parse_alloc_conf(joined)


def _tokens(text: str) -> list[str]:
    """PyTorch's lexArgs: split on ``,`` ``:`` ``[`` ``]`` (kept as tokens), spaces dropped."""
    out, word = [], ""
    for ch in text:
        if ch in ",:[]":
            if word:
                out.append(word)
                word = ""
            out.append(ch)
        elif not ch.isspace():
            word += ch
    if word:
        out.append(word)
    return out


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def parse_alloc_conf(text: str | None) -> AllocatorConfig:
    """Settings from a ``PYTORCH_CUDA_ALLOC_CONF`` string; an unknown option or a bad value is a
    ConfigError naming it (as PyTorch refuses them at start-up)."""
    text = (text or "").strip()
    t = _tokens(text)
    kw: dict = {}
    divisions = [0] * ROUNDUP_INTERVALS
    unmodelled: list[str] = []
    i = 0

    def value(j: int, key: str) -> tuple[str, int]:
        if j + 2 >= len(t) + 1 or j + 1 >= len(t) or t[j + 1] != ":" or j + 2 >= len(t):
            raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF {text!r}: {key} needs a value ({key}:VALUE)")
        return t[j + 2], j + 2

    def number(word: str, key: str, kind=int):
        try:
            return kind(word)
        except ValueError:
            raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF {text!r}: {key}: {word!r} is not a number") from None

    def boolean(word: str, key: str) -> bool:
        if word not in ("True", "False"):
            raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF {text!r}: {key} takes True or False, got {word!r}")
        return word == "True"

    while i < len(t):
        key = t[i]
        if key == ",":
            i += 1
            continue
        if key == "max_split_size_mb":
            word, i = value(i, key)
            mb = number(word, key)
            if mb <= K_LARGE_BUFFER // MIB:
                raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF {text!r}: max_split_size_mb too small, must be > "
                                  f"{K_LARGE_BUFFER // MIB}")
            kw["max_split_size"] = mb * MIB
        elif key == "max_non_split_rounding_mb":
            word, i = value(i, key)
            kw["max_non_split_rounding"] = number(word, key) * MIB
        elif key == "large_segment_size_mb":
            word, i = value(i, key)
            kw["large_segment_size"] = number(word, key) * MIB
        elif key == "garbage_collection_threshold":
            word, i = value(i, key)
            frac = number(word, key, float)
            if not 0.0 < frac < 1.0:
                raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF {text!r}: garbage_collection_threshold must be "
                                  "between 0.0 and 1.0")
            kw["garbage_collection_threshold"] = frac
        elif key == "expandable_segments":
            word, i = value(i, key)
            kw["expandable_segments"] = boolean(word, key)
        elif key == "roundup_power2_divisions":
            if i + 2 < len(t) and t[i + 1] == ":" and t[i + 2] == "[":
                i += 3
                first, last = True, 0
                while i < len(t) and t[i] != "]":
                    if t[i] == ",":
                        i += 1
                        continue
                    interval = t[i]
                    if i + 2 >= len(t) or t[i + 1] != ":":
                        raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF {text!r}: roundup_power2_divisions: "
                                          f"expected SIZE_MB:DIVISIONS, got {interval!r}")
                    div = number(t[i + 2], key)
                    if div != 0 and not _pow2(div):
                        raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF {text!r}: roundup_power2_divisions: "
                                          f"divisions must be a power of 2 (or 0), got {div}")
                    if interval == ">":  # from the interval after the last named one (c10 AllocatorConfig.cpp;
                        # torch <= 2.7's CUDAAllocatorConfig.cpp also overwrote the last named interval)
                        for k in range(last + 1 if not first else 0, ROUNDUP_INTERVALS):
                            divisions[k] = div
                    else:
                        mb = number(interval, key)
                        if not _pow2(mb):
                            raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF {text!r}: roundup_power2_divisions: "
                                              f"interval sizes must be powers of 2 (MB), got {mb}")
                        index = min(mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
                        if first:
                            for k in range(index):
                                divisions[k] = div
                            first = False
                        divisions[index] = div
                        last = index
                    i += 3
                if i >= len(t):
                    raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF {text!r}: roundup_power2_divisions: missing ']'")
            else:
                word, i = value(i, key)
                div = number(word, key)
                if not _pow2(div):
                    raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF {text!r}: roundup_power2_divisions must be a "
                                      f"power of 2, got {div}")
                divisions = [div] * ROUNDUP_INTERVALS
        elif key in _ACCEPTED:
            word, i = value(i, key)
            if key == "backend":
                if word not in ("native", "cudaMallocAsync"):
                    raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF {text!r}: backend must be native or cudaMallocAsync, "
                                      f"got {word!r}")
                kw["backend"] = word
                if word != "native":
                    unmodelled.append("backend:cudaMallocAsync (replayed as the native allocator)")
            else:
                unmodelled.append(key)
        else:
            raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF {text!r}: unknown option {key!r}; valid: "
                              f"{', '.join(_MODELLED + _ACCEPTED)}")
        i += 1
    return AllocatorConfig(roundup_power2_divisions=tuple(divisions), text=text, unmodelled=tuple(unmodelled), **kw)


# -- sizes --------------------------------------------------------------------------------------


def _divisions(cfg: AllocatorConfig, size: int) -> int:
    index = size.bit_length() - 1 - 20  # log2(size) - log2(1 MiB)
    return cfg.roundup_power2_divisions[max(0, min(index, ROUNDUP_INTERVALS - 1))]


def round_size(size: int, cfg: AllocatorConfig | None = None) -> int:
    """The block size a request of ``size`` bytes gets (``round_size``)."""
    if size < K_MIN_BLOCK:
        return K_MIN_BLOCK
    divisions = _divisions(cfg, size) if cfg is not None else 0
    if divisions > 1 and size > K_MIN_BLOCK * divisions:
        if _pow2(size):
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        low = size & ~(step - 1)
        return size if low == size else low + step
    return K_MIN_BLOCK * -(-size // K_MIN_BLOCK)


def allocation_size(size: int, cfg: AllocatorConfig | None = None) -> int:
    """The segment cudaMalloc'd for a (rounded) request no cached block holds (``get_allocation_size``)."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return cfg.large_segment_size if cfg is not None else K_LARGE_BUFFER
    return K_ROUND_LARGE * -(-size // K_ROUND_LARGE)


# -- results ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutOfMemory:
    """The request that failed, in the terms of PyTorch's "CUDA out of memory" message (bytes)."""

    event: int
    """index of the failing event in the stream"""
    request: int
    """the bytes asked for ("Tried to allocate")"""
    allocated: int
    """"allocated by PyTorch" at the failure"""
    reserved: int
    """"reserved by PyTorch" (allocated + reserved-but-unallocated) after the cache was emptied"""
    capacity: int
    free: int
    """what was left under the capacity ("of which ... is free")"""

    def message(self) -> str:
        """The figures as PyTorch's message states them."""
        def size(n: int) -> str:
            return f"{n / MIB / 1024:.2f} GiB" if n >= 1024 * MIB else f"{n / MIB:.2f} MiB"
        return (f"CUDA out of memory. Tried to allocate {size(self.request)}. Of the allocated memory "
                f"{size(self.allocated)} is allocated by PyTorch, and {size(self.reserved - self.allocated)} is "
                f"reserved by PyTorch but unallocated; {size(self.free)} free of the allocator's {size(self.capacity)}.")


@dataclass(frozen=True)
class Replay:
    """What the caching allocator did with a stream (bytes)."""

    peak_allocated: int
    """``torch.cuda.max_memory_allocated``: block sizes, after rounding and unsplit remainders"""
    peak_requested: int
    """the peak of the bytes asked for (before rounding)"""
    peak_reserved: int
    """``torch.cuda.max_memory_reserved``"""
    reserved_end: int
    allocated_end: int
    fragmentation: float
    """reserved-but-unallocated / reserved, at the reserved peak"""
    segments: int
    """segments (cudaMalloc calls alive) at the reserved peak; expandable: one per pool in use"""
    segments_end: int
    oom: OutOfMemory | None = None
    events: int = 0
    config: AllocatorConfig = field(default_factory=AllocatorConfig)
    marks: tuple[tuple[str, int, int], ...] = ()
    """(label, allocated, reserved) at each ``("mark", label)`` event"""
    peak_active: int = 0
    """``active_bytes.all.peak``: allocated blocks and deferred ones not yet back in their pools"""

    @property
    def fits(self) -> bool:
        return self.oom is None


# -- the model ----------------------------------------------------------------------------------


class _Block:
    __slots__ = ("addr", "size", "allocated", "mapped", "prev", "next", "small", "seg", "born", "pool")

    def __init__(self, addr: int, size: int, small: bool, seg: int, pool: "_Pool"):
        self.addr, self.size, self.small, self.seg, self.pool = addr, size, small, seg, pool
        self.allocated, self.mapped = False, True
        self.prev = self.next = None
        self.born = 0


class _Pool:
    """Free mapped blocks of one pool and one stream, ordered by (size, address): PyTorch's BlockPool
    orders by (stream, size, address) and never serves a request from another stream's blocks, which
    is a pool per stream. ``keys`` holds ``size << _ADDR_BITS | addr``, one int per block, sorted: the same
    order as (size, address) pairs, compared without building tuples (the replay's hottest path)."""

    __slots__ = ("keys", "blocks", "small", "calls", "unmapped", "page", "stream", "base")

    def __init__(self, small: bool, page: int, stream=0, calls: list[int] | None = None):
        self.keys: list[int] = []
        self.blocks: dict[int, _Block] = {}
        self.small, self.page, self.stream = small, page, stream
        self.calls = calls if calls is not None else [0]  # get_free_block calls, shared by the streams' pools
        self.unmapped: dict[int, _Block] = {}  # addr -> unmapped block (expandable)
        self.base: int | None = None  # start address of this pool's expandable segment

    def insert(self, b: _Block) -> None:
        insort(self.keys, b.size << _ADDR_BITS | b.addr)
        self.blocks[b.addr] = b
        b.born = self.calls[0]

    def remove(self, b: _Block) -> None:
        keys = self.keys
        del keys[bisect_left(keys, b.size << _ADDR_BITS | b.addr)]
        del self.blocks[b.addr]

    def first_at_least(self, size: int) -> int:
        """The index in ``keys`` of the smallest block of at least ``size`` bytes (``len(keys)``: none)."""
        return bisect_left(self.keys, size << _ADDR_BITS)

    def block(self, i: int) -> _Block:
        return self.blocks[self.keys[i] & _ADDR_MASK]


class CachingAllocator:
    """The allocator's state; ``malloc``/``free`` as PyTorch does them. Use ``replay`` for streams."""

    def __init__(self, capacity: int | None = None, config: AllocatorConfig | None = None):
        self.cfg = config or AllocatorConfig()
        self.capacity = capacity
        self.small = _Pool(True, K_SMALL_BUFFER)
        self.large = _Pool(False, self.cfg.large_segment_size)
        self._pools: dict[tuple, _Pool] = {(0, True): self.small, (0, False): self.large}
        self.allocated = self.requested = self.reserved = 0
        self.peak_allocated = self.peak_requested = self.peak_reserved = 0
        self.deferred: dict[int, _Block] = {}  # addr -> a block freed by the program, not yet back in its pool
        self.deferred_bytes = self.peak_active = 0
        self.segments = 0
        self.frag_at_peak = 0.0
        self.segments_at_peak = 0
        self._next_addr = 1 << 60
        self._next_seg = 0
        self._plain_rounding = not any(self.cfg.roundup_power2_divisions)
        self._gc = capacity is not None and self.cfg.garbage_collection_threshold > 0.0  # garbage collection on
        self._watch: int | None = None  # unbounded, watched for this capacity (replay_pair): _Diverged beyond it

    # -- helpers -------------------------------------------------------------------------------

    def _pool(self, stream, small: bool) -> _Pool:
        pool = self._pools.get((stream, small))
        if pool is None:
            page = K_SMALL_BUFFER if small else self.cfg.large_segment_size
            pool = self._pools[(stream, small)] = _Pool(small, page, stream, self._pools[(0, small)].calls)
        return pool

    def _new_segment(self, size: int, pool: _Pool) -> _Block:
        self._next_addr -= size + K_SMALL_BUFFER  # top down, as cudaMalloc: a newer segment has a lower address
        b = _Block(self._next_addr, size, pool.small, self._next_seg, pool)
        self._next_seg += 1
        return b

    def _should_split(self, b: _Block, size: int) -> bool:
        remaining = b.size - size
        if b.small or self.cfg.expandable_segments:
            return remaining >= K_MIN_BLOCK
        return size < self.cfg.max_split_size and remaining > K_SMALL_SIZE

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        if self._gc:
            pool.calls[0] += 1
        keys = pool.keys
        i = bisect_left(keys, size << _ADDR_BITS)  # pool.first_at_least, inlined: the replay's hottest path
        n = len(keys)
        if i == n:
            return None
        b = pool.blocks[keys[i] & _ADDR_MASK]
        cfg = self.cfg
        if cfg.expandable_segments:
            def grow(x: _Block) -> int:
                return x.size + (x.next.size if x.next is not None and not x.next.mapped else 0)
            while i + 1 < n and grow(pool.block(i + 1)) < grow(b):
                i += 1
                b = pool.block(i)
        else:
            if size < cfg.max_split_size and b.size >= cfg.max_split_size:
                return None
            if size >= cfg.max_split_size and b.size >= size + cfg.max_non_split_rounding:
                return None
        pool.remove(b)
        return b

    def _release_segment(self, b: _Block, pool: _Pool) -> None:
        pool.remove(b)
        self.reserved -= b.size
        self.segments -= 1

    def _release_cached(self) -> bool:
        """release_cached_blocks: every deferred block back to its pool (synchronize_and_free_events), then every
        cached unsplit segment (and free expandable pages)."""
        for b in list(self.deferred.values()):
            self.give_back(b)
        for pool in sorted(self._pools.values(), key=lambda x: x.small):  # large pools first
            for addr in list(pool.blocks):
                b = pool.blocks.get(addr)
                if b is None:
                    continue
                if self.cfg.expandable_segments:
                    self._unmap(b, pool)
                elif b.prev is None and b.next is None:
                    self._release_segment(b, pool)
        return True

    def _release_available(self, pool: _Pool, size: int) -> bool:
        """release_available_cached_blocks: with max_split_size set, free oversize cached segments."""
        cfg = self.cfg
        if cfg.max_split_size == NO_LIMIT or cfg.expandable_segments:
            return False
        key = max(size, cfg.max_split_size)
        i = pool.first_at_least(key)
        if i < len(pool.keys):
            self._release_segment(pool.block(i), pool)
            return True
        released, j = 0, len(pool.keys) - 1
        while j >= 0 and released < key:
            b = pool.block(j)
            if b.size < cfg.max_split_size:
                break
            self._release_segment(b, pool)
            released += b.size
            j -= 1
        return released >= key

    def _garbage_collect(self) -> None:
        """garbage_collect_cached_blocks: free old unsplit large-pool segments above the threshold."""
        limit = int(self.cfg.garbage_collection_threshold * self.capacity)
        if self.reserved <= limit:
            return
        target, reclaimed = self.reserved - limit, 0
        freeable = [b for pool in self._pools.values() if not pool.small
                    for b in pool.blocks.values() if b.prev is None and b.next is None]
        if not freeable:
            return
        ages = {b.addr: b.pool.calls[0] - b.born for b in freeable}
        total, count = sum(ages.values()), len(freeable)
        freed = True
        while reclaimed < target and freed and count > 0:
            threshold = total / count
            freed = False
            for b in sorted((x for x in freeable if x.addr in x.pool.blocks), key=lambda x: (x.size, x.addr)):
                if ages[b.addr] >= threshold:
                    freed = True
                    reclaimed += b.size
                    total -= ages[b.addr]
                    count -= 1
                    self._release_segment(b, b.pool)

    def _room(self, nbytes: int) -> bool:
        return self.capacity is None or self.reserved + nbytes <= self.capacity

    def _alloc_block(self, pool: _Pool, size: int) -> _Block | None:
        """alloc_block: a new segment (or, expandable, newly mapped pages)."""
        if self.cfg.expandable_segments:
            return self._expand(pool, size)
        nbytes = allocation_size(size, self.cfg)
        if not self._room(nbytes):
            return None
        if self._watch is not None and self.reserved + nbytes > self._watch:
            raise _Diverged()
        self.reserved += nbytes
        self.segments += 1
        return self._new_segment(nbytes, pool)

    # -- expandable segments ---------------------------------------------------------------------

    def _expand(self, pool: _Pool, size: int) -> _Block | None:
        if pool.base is None:
            head = self._new_segment(_ADDRESS_SPACE, pool)
            head.mapped = False
            pool.unmapped[head.addr] = head
            pool.base = head.addr
            self.segments += 1
        # find_expandable_block: the lowest unmapped range (with the free block before it) with room
        for addr in sorted(pool.unmapped):
            c = pool.unmapped[addr]
            if c.prev is not None and not c.prev.allocated and c.prev.mapped:
                c = c.prev
            room, x = 0, c
            while room < size and x is not None and not x.allocated:
                room += x.size
                x = x.next
            if room >= size:
                break
        else:  # pragma: no cover - the address space is "enough"
            return None
        # map what is missing, from c on
        if c.mapped:
            pool.remove(c)
        else:
            if not self._map(c, min(c.size, size), pool):
                return None
        while c.size < size:
            nxt = c.next
            if nxt.mapped:  # a free mapped block between unmapped ranges
                pool.remove(nxt)
            elif not self._map(nxt, min(nxt.size, size - c.size), pool):
                pool.insert(c)
                return None
            _merge(c, nxt)
        return c

    def _map(self, b: _Block, nbytes: int, pool: _Pool) -> bool:
        """Map whole pages at the front of unmapped ``b``; the mapped part stays ``b`` (taken out of
        the unmapped set), the rest becomes a new unmapped block after it."""
        pages = -(-nbytes // pool.page) * pool.page
        pages = min(pages, b.size)
        if not self._room(pages):
            return False
        del pool.unmapped[b.addr]
        if pages < b.size:
            rest = _Block(b.addr + pages, b.size - pages, b.small, b.seg, pool)
            rest.mapped = False
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            pool.unmapped[rest.addr] = rest
            b.size = pages
        b.mapped = True
        self.reserved += pages
        return True

    def _unmap(self, b: _Block, pool: _Pool) -> None:
        """unmap_block: the whole pages inside free block ``b`` go back to the driver."""
        page = pool.page
        start = -(-(b.addr - self._seg_base(b)) // page) * page + self._seg_base(b)
        end = (b.addr + b.size - self._seg_base(b)) // page * page + self._seg_base(b)
        if end <= start:
            return
        pool.remove(b)
        pieces = []
        if start > b.addr:
            pieces.append((b.addr, start - b.addr, True))
        pieces.append((start, end - start, False))
        if b.addr + b.size > end:
            pieces.append((end, b.addr + b.size - end, True))
        prev, nxt = b.prev, b.next
        made = []
        for addr, size, mapped in pieces:
            x = _Block(addr, size, b.small, b.seg, pool)
            x.mapped = mapped
            made.append(x)
        for a, c in zip(made, made[1:]):
            a.next, c.prev = c, a
        made[0].prev, made[-1].next = prev, nxt
        if prev is not None:
            prev.next = made[0]
        if nxt is not None:
            nxt.prev = made[-1]
        self.reserved -= end - start
        for x in made:
            if x.mapped:
                pool.insert(x)
        hole = next(x for x in made if not x.mapped)
        # merge with unmapped neighbours
        for other in (hole.prev, hole.next):
            if other is not None and not other.mapped and not other.allocated:
                del pool.unmapped[other.addr]
                lo, hi = (other, hole) if other.addr < hole.addr else (hole, other)
                _merge(lo, hi)
                hole = lo
        pool.unmapped[hole.addr] = hole

    def _seg_base(self, b: _Block) -> int:
        base = b.pool.base
        return b.addr if base is None else base

    # -- the API ---------------------------------------------------------------------------------

    def malloc(self, nbytes: int, stream=0) -> _Block | None:
        """A block for ``nbytes`` on ``stream`` (None: out of memory, the cache already emptied)."""
        if self._plain_rounding:
            size = K_MIN_BLOCK if nbytes < K_MIN_BLOCK else -(-nbytes // K_MIN_BLOCK) * K_MIN_BLOCK
        else:
            size = round_size(nbytes, self.cfg)
        small = size <= K_SMALL_SIZE
        pool = (self.small if small else self.large) if stream == 0 else self._pool(stream, small)
        b = self._get_free_block(pool, size)
        if b is None:
            if self._gc:
                self._garbage_collect()
            b = self._alloc_block(pool, size)
            if b is None and self._release_available(pool, size):
                b = self._alloc_block(pool, size)
            if b is None:
                self._release_cached()
                b = self._alloc_block(pool, size)
            if b is None:
                return None
        if self._should_split(b, size):
            rest = _Block(b.addr + size, b.size - size, small, b.seg, pool)
            nxt = rest.next = b.next
            rest.prev = b
            if nxt is not None:
                nxt.prev = rest
            b.next = rest
            b.size = size
            pool.insert(rest)
        b.allocated = True
        allocated = self.allocated = self.allocated + b.size
        requested = self.requested = self.requested + nbytes
        if allocated > self.peak_allocated:
            self.peak_allocated = allocated
        if allocated + self.deferred_bytes > self.peak_active:
            self.peak_active = allocated + self.deferred_bytes
        if requested > self.peak_requested:
            self.peak_requested = requested
        reserved = self.reserved
        if reserved >= self.peak_reserved:
            if reserved > self.peak_reserved or reserved - allocated < self.frag_at_peak * reserved:
                self.peak_reserved = reserved
                self.frag_at_peak = (reserved - allocated) / reserved if reserved else 0.0
                self.segments_at_peak = self.segments
        return b

    def free(self, b: _Block, nbytes: int) -> None:
        """free_block: back to its pool, merged with free neighbours."""
        self.allocated -= b.size
        self.requested -= nbytes
        self._to_pool(b)

    def defer(self, b: _Block, nbytes: int) -> None:
        """The program frees a block another stream still uses (``record_stream``): it leaves the allocated
        bytes and waits, out of its pool, for ``give_back``."""
        self.allocated -= b.size
        self.requested -= nbytes
        self.deferred[b.addr] = b
        self.deferred_bytes += b.size

    def give_back(self, b: _Block) -> bool:
        """A deferred block's event completed: back to its pool (False: it already came back)."""
        if self.deferred.pop(b.addr, None) is not b:
            return False
        self.deferred_bytes -= b.size
        self._to_pool(b)
        return True

    def _to_pool(self, b: _Block) -> None:
        """Into its pool, merged with the free mapped neighbours of its segment."""
        pool = b.pool
        b.allocated = False
        prev, nxt = b.prev, b.next
        if prev is not None and not prev.allocated and prev.mapped:
            pool.remove(prev)
            _merge(prev, b)
            b = prev
        if nxt is not None and not nxt.allocated and nxt.mapped:
            pool.remove(nxt)
            _merge(b, nxt)
        pool.insert(b)


def _merge(lo: _Block, hi: _Block) -> None:
    """``hi``, the block after ``lo`` in its segment, becomes part of ``lo``."""
    lo.size += hi.size
    after = lo.next = hi.next
    if after is not None:
        after.prev = lo


class _Diverged(Exception):
    """An unbounded allocator watched for ``capacity`` asked the driver for more than it: a bounded one would
    release its cache or fail here, so the two replays part (raised before the request changed any state)."""

    event = -1
    """the index of the request in the stream (set by ``_Run.go``)"""


class _Run:
    """One replay's allocator and books (live ids, deferred ids, marks), resumable at an event index."""

    __slots__ = ("a", "live", "deferred", "marks")

    def __init__(self, a: CachingAllocator, live: dict, deferred: dict, marks: list):
        self.a, self.live, self.deferred, self.marks = a, live, deferred, marks

    def go(self, events: Iterable[Sequence], start: int = 0) -> Replay:
        """Replay ``events`` (from index ``start`` of a sequence) to their end or the first OOM; ``_Diverged``
        propagates with ``.event`` set to the index of the request that raised it."""
        a, live, deferred, marks = self.a, self.live, self.deferred, self.marks
        capacity = a.capacity
        oom = None
        n = start
        malloc, free = a.malloc, a.free
        if start:
            events = islice(events, start, None)
        for n, ev in enumerate(events, start + 1):
            kind = ev[0]
            if kind == "alloc" or kind == "a":
                key, nbytes = ev[1], int(ev[2])
                if key in live:
                    raise ValueError(f"allocator stream: id {key!r} allocated twice without a free (event {n - 1})")
                try:
                    if len(ev) > 3:
                        stream = ev[3]
                        try:
                            hash(stream)
                        except TypeError:
                            raise ValueError(f"allocator stream: stream {stream!r} of id {key!r} is not a name "
                                             f"(event {n - 1})") from None
                        b = malloc(nbytes, stream)
                    else:
                        b = malloc(nbytes)
                except _Diverged as e:
                    e.event = n - 1
                    raise
                if b is None:
                    reserved = a.reserved
                    oom = OutOfMemory(event=n - 1, request=nbytes, allocated=a.allocated, reserved=reserved,
                                      capacity=capacity or 0, free=max(0, (capacity or 0) - reserved))
                    break
                live[key] = (b, nbytes)
            elif kind == "free" or kind == "f":
                got = live.pop(ev[1], None)
                if got is None:
                    raise ValueError(f"allocator stream: free of id {ev[1]!r} that is not live (event {n - 1})")
                free(*got)
            elif kind == "defer":
                got = live.pop(ev[1], None)
                if got is None:
                    raise ValueError(f"allocator stream: defer of id {ev[1]!r} that is not live (event {n - 1})")
                a.defer(*got)
                deferred[ev[1]] = got[0]
            elif kind == "return":
                b = deferred.pop(ev[1], None)
                if b is None:
                    raise ValueError(f"allocator stream: return of id {ev[1]!r} that was not deferred "
                                     f"(event {n - 1})")
                a.give_back(b)
            elif kind == "mark":
                marks.append((str(ev[1]), a.allocated, a.reserved))
            else:
                raise ValueError(f"allocator stream: unknown event {kind!r} (event {n - 1})")
        return Replay(peak_allocated=a.peak_allocated, peak_requested=a.peak_requested,
                      peak_reserved=a.peak_reserved, reserved_end=a.reserved, allocated_end=a.allocated,
                      fragmentation=a.frag_at_peak if a.peak_reserved else 0.0, segments=a.segments_at_peak,
                      segments_end=a.segments, oom=oom, events=n, config=a.cfg, marks=tuple(marks),
                      peak_active=a.peak_active)

    def fork(self, capacity: int | None) -> "_Run":
        """An independent copy of this run (its allocator's blocks, pools and books) under ``capacity``."""
        a = self.a
        new = object.__new__(CachingAllocator)
        new.__dict__.update(a.__dict__)
        new.capacity = capacity
        new._gc = capacity is not None and a.cfg.garbage_collection_threshold > 0.0
        new._watch = None
        calls: dict[int, list[int]] = {}
        pools: dict[int, _Pool] = {}
        for key, p in a._pools.items():
            q = object.__new__(_Pool)
            q.keys, q.small, q.page, q.stream, q.base = list(p.keys), p.small, p.page, p.stream, p.base
            q.calls = calls.setdefault(id(p.calls), list(p.calls))
            pools[id(p)] = q
        made: dict[int, _Block] = {}  # id(old block) -> its copy

        def copy_segment(b: _Block) -> None:
            while b.prev is not None:
                b = b.prev
            prev = None
            while b is not None:
                c = object.__new__(_Block)
                c.addr, c.size, c.allocated, c.mapped, c.small, c.seg, c.born = (
                    b.addr, b.size, b.allocated, b.mapped, b.small, b.seg, b.born)
                c.pool, c.prev, c.next = pools[id(b.pool)], prev, None
                if prev is not None:
                    prev.next = c
                made[id(b)] = prev = c
                b = b.next

        known = [b for p in a._pools.values() for b in (*p.blocks.values(), *p.unmapped.values())]
        known += [b for b, _ in self.live.values()]
        known += a.deferred.values()
        for b in known:
            if id(b) not in made:
                copy_segment(b)
        new._pools = {key: pools[id(p)] for key, p in a._pools.items()}
        new.small, new.large = new._pools[(0, True)], new._pools[(0, False)]
        for p in a._pools.values():
            q = pools[id(p)]
            q.blocks = {addr: made[id(b)] for addr, b in p.blocks.items()}
            q.unmapped = {addr: made[id(b)] for addr, b in p.unmapped.items()}
        new.deferred = {addr: made[id(b)] for addr, b in a.deferred.items()}
        return _Run(new, {k: (made[id(b)], n) for k, (b, n) in self.live.items()},
                    {k: made[id(b)] for k, b in self.deferred.items()}, list(self.marks))


def _config(config: AllocatorConfig | str | None) -> AllocatorConfig:
    return config if isinstance(config, AllocatorConfig) else parse_alloc_conf(config)


def replay(events: Iterable[Sequence], capacity: int | None = None,
           config: AllocatorConfig | str | None = None) -> Replay:
    """Replay ``events`` (``("alloc", id, nbytes)``, ``("free", id)``, ``("defer", id)``, ``("return", id)``,
    ``("mark", label)``) through
    the caching allocator under ``capacity`` bytes (None: unbounded) and ``config`` (an
    ``AllocatorConfig`` or a ``PYTORCH_CUDA_ALLOC_CONF`` string). Stops at the first OOM.
    Freeing an id that is not live is a ValueError (a broken stream, not a memory fact)."""
    return _Run(CachingAllocator(capacity, _config(config)), {}, {}, []).go(events)


def replay_pair(events: Sequence[Sequence], capacity: int,
                config: AllocatorConfig | str | None = None) -> tuple[Replay, Replay]:
    """``(replay(events, None, config), replay(events, capacity, config))``, their common prefix replayed once.

    The two allocators do the same, event by event, until the unbounded one first asks the driver for a
    segment beyond ``capacity`` (there the bounded one releases its cache or fails): the run is copied at that
    request and each goes on alone. When that never happens the bounded replay is the unbounded one (the
    same object). Expandable segments part mid-request (a request maps pages before it can fail): the bounded
    run is replayed from the start when the unbounded one went beyond the capacity. Garbage collection frees
    cached segments under a capacity before any request fails (its clock runs only there): replayed twice."""
    cfg = _config(config)
    events = events if isinstance(events, (list, tuple)) else list(events)
    if cfg.garbage_collection_threshold > 0.0:
        return replay(events, None, cfg), replay(events, capacity, cfg)
    if cfg.expandable_segments:
        free = replay(events, None, cfg)
        return free, (free if free.peak_reserved <= capacity else replay(events, capacity, cfg))
    run = _Run(CachingAllocator(None, cfg), {}, {}, [])
    run.a._watch = capacity
    try:
        free = run.go(events)
        return free, free
    except _Diverged as e:
        at = e.event
    bounded = run.fork(capacity).go(events, at)
    run.a._watch = None
    return run.go(events, at), bounded
