"""The caching-allocator model (toolkit/estimate/allocator.py) on hand-worked sequences.

Each expected figure is worked out by hand from the policy of c10/cuda/CUDACachingAllocator.cpp.
"""

from __future__ import annotations

import random

import pytest

from toolkit.errors import ConfigError
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit.estimate.allocator import (K_LARGE_BUFFER, K_SMALL_BUFFER, MIB, CachingAllocator, allocation_size,
                                        parse_alloc_conf, replay, replay_pair, round_size)


def A(i, n):
    return ("alloc", i, n)


def F(i):
    return ("free", i)


def test_rounding_to_512_bytes():
    assert round_size(1) == 512
    assert round_size(512) == 512
    assert round_size(513) == 1024
    r = replay([A(1, 1), A(2, 513)])
    assert r.peak_allocated == 512 + 1024 and r.peak_requested == 514
    assert r.peak_reserved == K_SMALL_BUFFER and r.segments == 1


def test_small_and_large_pool_choice_and_segment_sizes():
    assert allocation_size(MIB) == K_SMALL_BUFFER            # <= 1 MiB: a 2 MiB small segment
    assert allocation_size(MIB + 512) == K_LARGE_BUFFER      # 1 .. 10 MiB: a 20 MiB segment
    assert allocation_size(10 * MIB - 512) == K_LARGE_BUFFER
    assert allocation_size(10 * MIB) == 10 * MIB             # >= 10 MiB: rounded up to 2 MiB
    assert allocation_size(11 * MIB) == 12 * MIB
    r = replay([A(1, MIB), A(2, MIB + 1)])
    assert r.peak_reserved == 2 * MIB + 20 * MIB and r.segments == 2


def test_small_large_pool_requests_share_one_20_mib_segment():
    # five 3 MiB requests: the first makes a 20 MiB segment, split; the next four reuse its remainder
    # (20 - 15 = 5 MiB left, > 1 MiB: still split); the 7th 3 MiB does not fit the 2 MiB left: a new segment
    evs = [A(i, 3 * MIB) for i in range(6)]
    r = replay(evs)
    assert r.peak_reserved == 20 * MIB and r.segments == 1 and r.peak_allocated == 18 * MIB
    r = replay(evs + [A(6, 3 * MIB)])
    assert r.peak_reserved == 40 * MIB and r.segments == 2
    assert r.fragmentation == pytest.approx((40 - 21) / 40)


def test_split_rule_large_pool_remainder_must_exceed_1_mib():
    # 19 MiB from a 20 MiB segment leaves exactly 1 MiB: not > 1 MiB, so not split: allocated counts 20 MiB
    r = replay([A(1, 3 * MIB), F(1), A(2, 19 * MIB)])
    # 19 MiB >= 10 MiB would make its own 20 MiB segment; but the cached 20 MiB block fits (best fit)
    assert r.peak_reserved == 20 * MIB
    assert r.allocated_end == 20 * MIB and r.peak_requested == 19 * MIB
    r = replay([A(1, 3 * MIB), F(1), A(2, 18 * MIB + 512), A(3, 600 * 1024)])
    # 20 - 18.0005 MiB = ~1.9995 MiB > 1 MiB: split; a small request still goes to the small pool
    assert r.allocated_end == 18 * MIB + 512 + 600 * 1024
    assert r.peak_reserved == 22 * MIB


def test_free_blocks_merge_and_are_reused_best_fit():
    evs = [A(1, 4 * MIB), A(2, 4 * MIB), A(3, 4 * MIB), A(4, 4 * MIB), F(2), F(3)]  # 8 MiB hole in the middle
    evs += [A(5, 8 * MIB)]  # the merged 8 MiB hole, no new segment
    r = replay(evs)
    assert r.peak_reserved == 20 * MIB and r.segments_end == 1
    # best fit: with a 2 MiB hole and the 10 MiB tail (20 - 10) free, a 2 MiB request takes the hole,
    # so the 10 MiB request still fits the tail (first fit would have taken the tail: a second segment)
    r = replay([A(1, 2 * MIB), A(2, 6 * MIB), A(3, 2 * MIB), F(1), A(4, 2 * MIB), A(5, 10 * MIB)])
    assert r.peak_reserved == 20 * MIB and r.segments_end == 1


def test_best_fit_ties_go_to_the_newest_segment_as_cuda_hands_addresses_out_top_down():
    # Blocks compare by (size, address) and cudaMalloc hands out addresses from the top down (seen in every
    # record of the H100 session: benchmarks/results/gpu-replay-traces-20261127), so of equal free blocks the one
    # in the newest segment is taken. seg1 (20 MiB) = [1: 3][2: 14][3: 3]; seg2 = 4's own 14 MiB; seg3 (20 MiB) =
    # [5: 6][14 free]. With 2 and 4 freed, three 14 MiB blocks tie; 6 takes seg3's, so freeing 1 and 3 makes
    # seg1 whole again and the 20 MiB request reuses it: 54 MiB reserved in 3 segments. Taking the oldest (seg1's)
    # would leave seg1 split and need a fourth segment: 74 MiB.
    evs = [A(1, 3 * MIB), A(2, 14 * MIB), A(3, 3 * MIB), A(4, 14 * MIB), A(5, 6 * MIB), F(2), F(4),
           A(6, 14 * MIB), F(1), F(3), A(7, 20 * MIB)]
    r = replay(evs)
    assert r.peak_reserved == 54 * MIB and r.segments_end == 3


def test_oversize_blocks_with_max_split_size():
    cfg = "max_split_size_mb:64"
    # a 100 MiB block is oversize: never split, and a small request may not take it
    r = replay([A(1, 100 * MIB), F(1), A(2, 30 * MIB)], config=cfg)
    assert r.peak_reserved == 130 * MIB and r.allocated_end == 30 * MIB
    # without the option the 30 MiB request splits the cached 100 MiB block
    r = replay([A(1, 100 * MIB), F(1), A(2, 30 * MIB)])
    assert r.peak_reserved == 100 * MIB
    # a large request may take an oversize block only if it wastes < 20 MiB (max_non_split_rounding)
    r = replay([A(1, 100 * MIB), F(1), A(2, 90 * MIB)], config=cfg)
    assert r.peak_reserved == 100 * MIB and r.allocated_end == 100 * MIB
    r = replay([A(1, 100 * MIB), F(1), A(2, 70 * MIB)], config=cfg)
    assert r.peak_reserved == 170 * MIB


def test_freeing_the_cache_before_an_oom_and_the_oom_itself():
    cap = 100 * MIB
    # 60 MiB cached and free, 50 MiB asked: cudaMalloc fails, cached unsplit segments are freed, retried
    r = replay([A(1, 60 * MIB), F(1), A(2, 50 * MIB)], capacity=cap)
    assert r.oom is None and r.reserved_end == 60 * MIB  # best fit: the 60 MiB block is reused (split)
    r = replay([A(1, 60 * MIB), A(9, 30 * MIB), F(1), A(2, 70 * MIB)], capacity=cap)
    assert r.oom is None and r.reserved_end == 100 * MIB and r.segments_end == 2
    # a split segment cannot be freed: 20 MiB segment partly used + 60 MiB free segment partly used
    evs = [A(1, 3 * MIB), A(2, 60 * MIB), A(3, 2 * MIB + 0), F(2), A(4, 40 * MIB), A(5, 30 * MIB)]
    r = replay(evs, capacity=cap)
    assert r.oom is not None
    assert r.oom.request == 30 * MIB and r.oom.allocated == 3 * MIB + 2 * MIB + 40 * MIB
    assert r.oom.reserved == 80 * MIB and r.oom.free == 20 * MIB
    assert "Tried to allocate 30.00 MiB" in r.oom.message()


def test_expandable_segments_grow_one_segment_without_fragmentation_across_it():
    # without: a 12 MiB, 12 MiB, free the first, 24 MiB: a third segment
    evs = [A(1, 12 * MIB), A(2, 12 * MIB), F(1), A(3, 24 * MIB)]
    r = replay(evs)
    assert r.peak_reserved == 48 * MIB and r.segments_end == 3
    # with: one large-pool segment mapped in 20 MiB pages: 12 -> 20 mapped, 24 -> 40, then 24 at the
    # free tail (16 MiB free after 24 used, grows by 20) -> 60 mapped; the 12 MiB hole stays
    r = replay(evs, config="expandable_segments:True")
    assert r.segments_end == 1 and r.peak_reserved == 60 * MIB
    # a freed hole is reused in place
    r = replay([A(1, 12 * MIB), A(2, 12 * MIB), F(1), A(3, 12 * MIB)], config="expandable_segments:True")
    assert r.peak_reserved == 40 * MIB
    # two freed 12 MiB segments cannot serve a 24 MiB request (no merging across segments): 48 MiB;
    # in one expandable range the two freed blocks merge: 24 MiB fits the 40 MiB mapped
    evs = [A(1, 12 * MIB), A(2, 12 * MIB), F(1), F(2), A(3, 24 * MIB)]
    assert replay(evs).peak_reserved == 48 * MIB
    r = replay(evs, config="expandable_segments:True")
    assert r.peak_reserved == 40 * MIB and r.fragmentation == pytest.approx(16 / 40)


def test_expandable_segments_release_free_pages_before_an_oom():
    cfg = "expandable_segments:True"
    # ten 1 MiB small-pool blocks map 10 MiB of 2 MiB pages; all freed, a 70 MiB request under an 80 MiB cap
    # needs 80 MiB of large pages: the map fails, the free small pages are unmapped, the retry fits
    evs = [A(i, MIB) for i in range(10)] + [F(i) for i in range(10)] + [A(99, 70 * MIB)]
    r = replay(evs, capacity=80 * MIB, config=cfg)
    assert r.oom is None and r.reserved_end == 80 * MIB and r.peak_reserved == 80 * MIB
    # pages are the granule: 10 MiB used + 55 MiB asked maps 20 + 60 MiB, over a 70 MiB cap even after
    # the free pages are unmapped
    evs = [A(1, 10 * MIB), A(2, 50 * MIB), F(2), A(3, 55 * MIB)]
    r = replay(evs, capacity=70 * MIB, config=cfg)
    assert r.oom is not None and r.oom.reserved == 20 * MIB and r.oom.allocated == 10 * MIB


def test_roundup_power2_divisions():
    cfg = parse_alloc_conf("roundup_power2_divisions:4")
    # 1200 MiB lies between 1024 and 2048: quarters of 256 MiB -> 1280 MiB
    assert round_size(1200 * MIB, cfg) == 1280 * MIB
    assert round_size(1024 * MIB, cfg) == 1024 * MIB
    assert round_size(1000, cfg) == 1024  # below 512 x 4 bytes: plain 512 rounding
    cfg = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert cfg.roundup_power2_divisions[:8] == (1,) * 8 and cfg.roundup_power2_divisions[9] == 2
    # ">" covers the intervals after the last named one (torch >= 2.8; older releases also overwrote it)
    assert cfg.roundup_power2_divisions[10] == 4 and cfg.roundup_power2_divisions[11:] == (8,) * 5
    assert round_size(3 * MIB, cfg) == 3 * MIB  # divisions 1 in the 2-4 MiB interval: no power-of-2 rounding
    assert round_size(1200 * MIB, cfg) == 1280 * MIB
    assert round_size(3000 * MIB, cfg) == 3072 * MIB  # 2048..4096 in eighths of 256 MiB
    r = replay([A(1, 1200 * MIB)], config="roundup_power2_divisions:4")
    assert r.peak_allocated == 1280 * MIB and r.peak_requested == 1200 * MIB


def test_garbage_collection_threshold_frees_old_cached_segments_under_a_cap():
    cap = 200 * MIB
    evs = [A(1, 60 * MIB), F(1), A(2, 50 * MIB + 0), F(2)]
    evs = [A(1, 60 * MIB), A(2, 70 * MIB), F(1), F(2)] + [A(10 + i, 30 * MIB) for i in range(1)]
    plain = replay(evs + [A(99, 100 * MIB)], capacity=cap)
    gc = replay(evs + [A(99, 100 * MIB)], capacity=cap, config="garbage_collection_threshold:0.5")
    # both fit; with gc the cached 130 MiB above 100 MiB (0.5 x cap) is partly given back first
    assert plain.oom is None and gc.oom is None
    assert gc.reserved_end <= plain.reserved_end


def test_alloc_conf_parsing_names_what_it_refuses():
    with pytest.raises(ConfigError, match="'expandable_segment'"):
        parse_alloc_conf("expandable_segment:True")
    with pytest.raises(ConfigError, match="max_split_size_mb too small"):
        parse_alloc_conf("max_split_size_mb:10")
    with pytest.raises(ConfigError, match="power of 2"):
        parse_alloc_conf("roundup_power2_divisions:3")
    with pytest.raises(ConfigError, match="True or False"):
        parse_alloc_conf("expandable_segments:yes")
    cfg = parse_alloc_conf("max_split_size_mb:128, garbage_collection_threshold:0.6,expandable_segments:True")
    assert cfg.max_split_size == 128 * MIB and cfg.garbage_collection_threshold == 0.6 and cfg.expandable_segments
    assert parse_alloc_conf("").expandable_segments is False
    assert parse_alloc_conf("backend:cudaMallocAsync").unmodelled
    assert parse_alloc_conf("max_split_size_mb:128").with_option("expandable_segments:True").expandable_segments


def S(i, n, stream):
    return ("alloc", i, n, stream)


def test_each_cuda_stream_is_served_from_its_own_blocks():
    """CUDACachingAllocator orders a pool's free blocks by (stream, size, address) and only takes one of the
    request's stream: a 4 MiB block freed on the default stream is cached, but a side stream's 4 MiB request
    cannot have it and makes its own 20 MiB segment."""
    assert replay([A(1, 4 * MIB), F(1), A(2, 4 * MIB)]).peak_reserved == 20 * MIB
    r = replay([A(1, 4 * MIB), F(1), S(2, 4 * MIB, "side")])
    assert r.peak_reserved == 40 * MIB and r.segments_end == 2
    # each stream reuses its own: the side stream's freed block serves its next request, the default stream's its own
    evs = [S(1, 4 * MIB, "side"), F(1), A(2, 4 * MIB), S(3, 4 * MIB, "side"), A(4, 4 * MIB)]
    assert replay(evs).peak_reserved == 40 * MIB
    # stream 0 is the default stream, written or not
    assert replay([A(1, 4 * MIB), F(1), S(2, 4 * MIB, 0)]).peak_reserved == 20 * MIB
    # expandable segments: one per pool and stream, each mapped in its own 20 MiB pages
    r = replay([A(1, 12 * MIB), S(2, 12 * MIB, "side")], config="expandable_segments:True")
    assert r.peak_reserved == 40 * MIB and r.segments_end == 2
    # before an OOM, release_cached_blocks frees every stream's cached segments: the side stream's free 30 MiB
    # segment goes back to the driver so that the default stream's 30 MiB fits under 40 MiB
    r = replay([S(1, 30 * MIB, "side"), F(1), A(2, 30 * MIB)], capacity=40 * MIB)
    assert r.oom is None and r.reserved_end == 30 * MIB and r.segments_end == 1
    with pytest.raises(ValueError, match="is not a name"):
        replay([S(1, 10, ["side"])])


def D(i):
    return ("defer", i)


def R(i):
    return ("return", i)


def test_a_deferred_free_leaves_allocated_but_not_its_pool_until_it_returns():
    """record_stream: the program's free drops max_memory_allocated at once; the block comes back to its pool
    (and can be reused) only at its return, so a request meanwhile makes a segment of its own."""
    r = replay([A(1, 40 * MIB), D(1), A(2, 40 * MIB)])
    assert r.peak_allocated == 40 * MIB and r.peak_reserved == 80 * MIB and r.peak_active == 80 * MIB
    assert r.allocated_end == 40 * MIB and r.segments_end == 2
    r = replay([A(1, 40 * MIB), D(1), R(1), A(2, 40 * MIB)])  # returned first: reused, as a plain free
    assert r.peak_reserved == 40 * MIB and r.peak_active == 40 * MIB and r.segments_end == 1
    # a deferred block does not merge with its free neighbour until it returns: two halves of one 60 MiB segment
    head = [A(1, 60 * MIB), F(1), A(2, 30 * MIB), A(3, 30 * MIB), F(2)]
    r = replay(head + [F(3), A(4, 50 * MIB)])
    assert r.peak_reserved == 60 * MIB  # the halves merged: 4 fits the segment
    r = replay(head + [D(3), A(4, 50 * MIB), R(3), A(5, 50 * MIB)])
    assert r.peak_reserved == 110 * MIB  # 4 could not use 2 + 3: a segment of its own; 5 takes the merged 60
    assert r.reserved_end == 110 * MIB and r.allocated_end == 100 * MIB and r.segments_end == 2


def test_deferred_blocks_come_back_before_an_out_of_memory_error():
    """release_cached_blocks first synchronizes every outstanding event (synchronize_and_free_events): what is
    deferred returns and its segment is freed, so a step that fits without deferred frees fits with them."""
    cap = 100 * MIB
    r = replay([A(1, 60 * MIB), D(1), A(2, 60 * MIB), R(1)], capacity=cap)
    assert r.oom is None and r.reserved_end == 60 * MIB and r.peak_reserved == 60 * MIB  # the later return: no-op
    assert r.peak_active == 60 * MIB  # the synchronization took the deferred block out before the new one
    r = replay([A(1, 60 * MIB), D(1), A(2, 60 * MIB)])
    assert r.peak_reserved == 120 * MIB  # unbounded: both segments


def _deferring_stream(ops, capacity):
    """A stream from hypothesis's choices: alloc / free / defer / return, each on a live (or deferred) id."""
    live, deferred, evs, k = [], [], [], 0
    for op, size, pick in ops:
        if op == "alloc" or not (live or deferred):
            evs.append(A(k, size))
            live.append(k)
            k += 1
        elif op in ("free", "defer") and live:
            i = live.pop(pick % len(live))
            evs.append(F(i) if op == "free" else D(i))
            if op == "defer":
                deferred.append(i)
        elif deferred:
            evs.append(R(deferred.pop(pick % len(deferred))))
    return evs


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "free", "defer", "return"]),
                              st.sampled_from([700, 300 * 1024, 3 * MIB, 12 * MIB, 30 * MIB]),
                              st.integers(0, 1000)), max_size=80),
       capacity=st.sampled_from([None, 64 * MIB, 128 * MIB]),
       conf=st.sampled_from(["", "expandable_segments:True", "max_split_size_mb:32"]))
def test_deferred_frees_keep_the_allocators_books(ops, capacity, conf):
    """On any stream: allocated <= active <= reserved at the peaks; an out-of-memory error comes only after every
    deferred block came back (synchronize_and_free_events); turning every defer into a free never raises the
    allocated peak."""
    evs = _deferring_stream(ops, capacity)
    a = CachingAllocator(capacity, parse_alloc_conf(conf))
    live, waiting = {}, {}
    for ev in evs:
        if ev[0] == "alloc":
            b = a.malloc(ev[2])
            if b is None:
                assert not a.deferred  # all came back before the allocator gave up
                break
            live[ev[1]] = (b, ev[2])
        elif ev[0] == "free":
            a.free(*live.pop(ev[1]))
        elif ev[0] == "defer":
            b, n = live.pop(ev[1])
            a.defer(b, n)
            waiting[ev[1]] = b
        else:
            a.give_back(waiting.pop(ev[1]))
        assert a.allocated + a.deferred_bytes <= a.reserved
    r = replay(evs, capacity, conf)
    assert r.peak_allocated <= r.peak_active <= r.peak_reserved or r.oom is not None
    if capacity is None:
        plain = replay([F(e[1]) if e[0] == "defer" else e for e in evs if e[0] != "return"], None, conf)
        assert plain.peak_allocated == r.peak_allocated


def test_replay_pair_is_the_two_replays_with_their_common_prefix_run_once():
    # 100 MiB freed and kept cached, 3 MiB split off it, then 120 MiB: the unbounded allocator makes a second
    # segment (223 MiB); under 200 MiB that request is where the two part (the bounded one fails: the split
    # segment cannot be released)
    evs = [A(1, 100 * MIB), F(1), A(0, 3 * MIB), A(2, 120 * MIB), F(2), A(3, 10 * MIB)]
    free, bounded = replay_pair(evs, 200 * MIB)
    assert free == replay(evs) and bounded == replay(evs, 200 * MIB)
    assert free.oom is None and free.peak_reserved == 220 * MIB
    assert bounded.oom is not None and bounded.oom.event == 3 and bounded.events == 4
    free, bounded = replay_pair(evs, 300 * MIB)  # never beyond the capacity: one replay, one result
    assert bounded is free and free == replay(evs, 300 * MIB)
    # a cached 12 MiB segment: under 40 MiB the bounded run releases it for the 30 MiB request and has no room
    # for the second 12 MiB; the unbounded run must still hold it and serve the second 12 MiB from it (42 MiB)
    evs = [A(1, 12 * MIB), F(1), A(2, 30 * MIB), A(3, 12 * MIB)]
    free, bounded = replay_pair(evs, 40 * MIB)
    assert free == replay(evs) and free.peak_reserved == 42 * MIB and free.segments_end == 2
    assert bounded == replay(evs, 40 * MIB) and bounded.oom is not None and bounded.oom.event == 3


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "free", "defer", "return"]),
                              st.sampled_from([700, 300 * 1024, 3 * MIB, 12 * MIB, 30 * MIB]),
                              st.integers(0, 1000)), max_size=80),
       capacity=st.sampled_from([0, 40 * MIB, 64 * MIB, 128 * MIB]),
       side=st.integers(0, 3),
       conf=st.sampled_from(["", "max_split_size_mb:32", "roundup_power2_divisions:4", "expandable_segments:True",
                             "garbage_collection_threshold:0.6"]))
def test_replay_pair_equals_the_unbounded_and_the_bounded_replay(ops, capacity, side, conf):
    """On any stream (deferred frees and a side stream's allocations included) and setting, the pair is exactly
    what the two replays give, whatever request the runs part at."""
    evs = [e + ("reduce",) if e[0] == "alloc" and side and e[1] % side == 0 else e
           for e in _deferring_stream(ops, capacity)]
    free, bounded = replay_pair(evs, capacity, conf)
    assert free == replay(evs, None, conf)
    assert bounded == replay(evs, capacity, conf)


def test_broken_streams_are_errors():
    with pytest.raises(ValueError, match="not live"):
        replay([F(1)])
    with pytest.raises(ValueError, match="twice"):
        replay([A(1, 10), A(1, 10)])
    with pytest.raises(ValueError, match="defer of id 1 that is not live"):
        replay([A(1, 10), F(1), D(1)])
    with pytest.raises(ValueError, match="return of id 1 that was not deferred"):
        replay([A(1, 10), F(1), R(1)])


def _stream(n, seed=0):
    rnd = random.Random(seed)
    live, evs, k = [], [], 0
    while len(evs) < n:
        if live and rnd.random() < 0.48:
            evs.append(F(live.pop(rnd.randrange(len(live)))))
        else:
            size = rnd.choice([rnd.randint(1, 4096), rnd.randint(4096, 2 * MIB), rnd.randint(2 * MIB, 64 * MIB)])
            evs.append(A(k, size))
            live.append(k)
            k += 1
    return evs


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:32"])
def test_invariants_on_random_streams(conf):
    r = replay(_stream(3000, seed=len(conf)), config=conf)
    assert r.peak_requested <= r.peak_allocated <= r.peak_reserved
    assert 0.0 <= r.fragmentation < 1.0


def test_a_long_stream_forked_midway_gives_the_two_replays():
    """The fork copies a run holding many blocks (thousands of events in): the pair is still the two replays.
    (How fast a replay is is measured in benchmarks/estimator.py, not asserted here.)"""
    evs = _stream(20_000)
    free = replay(evs)
    cap = free.peak_reserved * 3 // 4
    pair = replay_pair(evs, cap)
    assert pair[0] == free and pair[1] == replay(evs, cap)
    assert pair[1].oom is not None or pair[1].peak_reserved <= cap


# -- device_memory: fit, reserved over capacity, the setting that fixes it ----------------------------


def test_device_memory_names_the_setting_that_makes_a_fragmented_step_fit():
    from toolkit.estimate.device import device_memory

    # 100 MiB freed, a 3 MiB tensor splits its cached block, then 120 MiB: a second segment (223 MiB
    # reserved) under a 200 MiB cap; the first segment is split so it cannot be released: OOM, though
    # the tensors (123 MiB) fit. Expandable segments grow the free tail by 20 MiB pages: 140 MiB.
    evs = [A(1, 100 * MIB), F(1), A(0, 3 * MIB), A(2, 120 * MIB)]
    dm = device_memory(evs, capacity_mib=200)
    assert not dm.fits and dm.fits_allocated and dm.fragmentation_only
    assert dm.peak_allocated_mib == 123
    assert dm.oom is not None and dm.oom.request == 120 * MIB
    assert dm.fix == "expandable_segments:True" and dm.fix_peak_reserved_mib == 140
    ok = device_memory(evs, capacity_mib=300)
    assert ok.fits and ok.fix is None and ok.peak_reserved_mib == 220
    too_big = device_memory(evs, capacity_mib=100)
    assert not too_big.fits and not too_big.fits_allocated and too_big.fix is None
    # with the setting already given, the replay uses it and fits
    assert device_memory(evs, capacity_mib=200, alloc_conf="expandable_segments:True").fits


def test_device_memory_shows_what_garbage_collection_keeps_under_the_capacity():
    from toolkit.estimate.device import device_memory

    # 30 MiB cached, 32 MiB a new segment (62 reserved), freed; 34 MiB misses the cache with 62 MiB reserved, above
    # half of the 100 MiB capacity: the collector frees the cached segments at least as old as their mean age (the
    # 30 MiB one, 2 calls old against 1.5; it covers the 12 MiB over the threshold), and 34 MiB makes 66. Unbounded
    # the three segments stay: 96 MiB, which fits under the capacity too, so the bounded replay cannot be skipped.
    evs = [A(1, 30 * MIB), F(1), A(2, 32 * MIB), F(2), A(3, 34 * MIB)]
    dm = device_memory(evs, capacity_mib=100, alloc_conf="garbage_collection_threshold:0.5")
    assert dm.fits and dm.peak_reserved_mib == 66 and dm.unbounded.peak_reserved == 96 * MIB


def test_device_memory_caches_replays_by_key():
    from toolkit.estimate.device import device_memory

    calls = []

    def make():
        calls.append(1)
        return [A(1, 5 * MIB)]

    device_memory(make, capacity_mib=None, key=("test-cache", 1))
    device_memory(make, capacity_mib=None, key=("test-cache", 1))
    assert len(calls) == 1
