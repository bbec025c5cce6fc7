"""The CUDA caching-allocator model against peaks worked out by hand from the allocator's rules
(c10/cuda/CUDACachingAllocator.cpp; the rules are listed in docs/planning.md). Each sequence is
built so that one rule decides its reserved peak."""

import pytest

from gradaccum.planning.estimate.allocator import (
    AllocatorConfig,
    replay,
    replay_snapshot,
    round_size,
)

KiB, MiB = 1 << 10, 1 << 20


def seq(*steps):
    """("a", key, size) allocates, ("f", key) frees."""
    return [("alloc", s[1], s[2]) if s[0] == "a" else ("free", s[1], 0) for s in steps]


def test_round_size_512_and_power_of_two_divisions():
    assert [round_size(n) for n in (1, 511, 512, 513, 1200)] == [512, 512, 512, 1024, 1536]
    # divisions apply above 512 * divisions only: 1200 keeps 512 rounding; 5000 lies between
    # 4096 and 8192, whose quarters are 1024 apart
    assert round_size(1200, 4) == 1536
    assert round_size(5000, 4) == 5120
    assert round_size(8192, 4) == 8192


def test_small_requests_share_a_2mib_segment():
    r = replay(seq(*(("a", i, 1000) for i in range(10))))
    assert (r.peak_allocated, r.peak_reserved, r.segments) == (10 * 1024, 2 * MiB, 1)


def test_small_pool_opens_a_second_segment_when_the_first_is_full():
    # 600 KiB rounds to itself; three fill 1800 KiB of 2048, the fourth needs a new segment
    r = replay(seq(*(("a", i, 600 * KiB) for i in range(4))))
    assert (r.peak_allocated, r.peak_reserved) == (2400 * KiB, 4 * MiB)


def test_requests_between_1_and_10_mib_pack_into_20mib_segments():
    # twelve 1.5 MiB blocks split a 20 MiB segment down to 2 MiB; the thirteenth would leave
    # 0.5 MiB, too little to split, so it takes the whole 2 MiB; the fourteenth opens a second
    r = replay(seq(*(("a", i, 3 * MiB // 2) for i in range(14))))
    assert (r.peak_allocated, r.peak_reserved) == (
        12 * 3 * MiB // 2 + 2 * MiB + 3 * MiB // 2,
        40 * MiB,
    )


def test_a_remainder_of_1mib_or_less_is_not_split_and_counts_as_allocated():
    # 11 MiB: a 12 MiB segment whose 1 MiB rest is too small to split, so the whole block is
    # handed out and max_memory_allocated counts 12 MiB
    r = replay(seq(("a", 0, 11 * MiB)))
    assert (r.peak_allocated, r.peak_reserved) == (12 * MiB, 12 * MiB)


def test_freed_blocks_are_reused_best_fit_and_split():
    r = replay(seq(("a", 0, 100 * MiB), ("f", 0), ("a", 1, 60 * MiB), ("a", 2, 50 * MiB)))
    # 60 MiB splits the cached 100 MiB; the 40 MiB rest cannot hold 50 MiB: a new segment
    assert (r.peak_allocated, r.peak_reserved) == (110 * MiB, 150 * MiB)
    r = replay(seq(("a", 0, 100 * MiB), ("a", 1, 40 * MiB), ("f", 0), ("f", 1), ("a", 2, 30 * MiB)))
    # best fit: 30 MiB takes the 40 MiB block, not the 100 MiB one; nothing new
    assert r.peak_reserved == 140 * MiB and r.reserved == 140 * MiB


def test_growing_sizes_fragment_without_expandable_segments_and_not_with():
    steps = seq(("a", 0, 12 * MiB), ("f", 0), ("a", 1, 14 * MiB), ("f", 1), ("a", 2, 16 * MiB))
    assert replay(steps).peak_reserved == (12 + 14 + 16) * MiB
    expandable = AllocatorConfig(expandable_segments=True)
    # one segment of 20 MiB pages: 12 maps a page; freed, 14 and 16 fit in it
    assert replay(steps, expandable).peak_reserved == 20 * MiB


def test_expandable_segment_maps_only_what_the_free_end_lacks():
    expandable = AllocatorConfig(expandable_segments=True)
    # 30 maps two pages (40), leaving 10 free at the end; 30 more maps one page onto those 10
    r = replay(seq(("a", 0, 30 * MiB), ("a", 1, 30 * MiB)), expandable)
    assert (r.peak_allocated, r.peak_reserved, r.segments) == (60 * MiB, 60 * MiB, 1)


def test_max_split_size_keeps_large_blocks_whole():
    steps = seq(("a", 0, 100 * MiB), ("f", 0), ("a", 1, 30 * MiB))
    assert replay(steps).peak_reserved == 100 * MiB
    limited = AllocatorConfig.parse("max_split_size_mb:64")
    assert limited.max_split_size == 64 * MiB
    # under the limit, a request never takes a block at or over it: a new segment
    assert replay(steps, limited).peak_reserved == 130 * MiB
    # at or over the limit, a block is reused whole only within 20 MiB of the request
    near = seq(("a", 0, 100 * MiB), ("f", 0), ("a", 1, 90 * MiB))
    far = seq(("a", 0, 100 * MiB), ("f", 0), ("a", 1, 70 * MiB))
    assert replay(near, limited).peak_allocated == 100 * MiB
    assert replay(far, limited).peak_reserved == 170 * MiB


def test_alloc_conf_parsing_and_refusals():
    conf = AllocatorConfig.parse("expandable_segments:True, max_split_size_mb:10")
    assert conf.expandable_segments and conf.max_split_size == 20 * MiB  # raised to 20 MiB
    assert AllocatorConfig.parse("roundup_power2_divisions:4").roundup_power2_divisions == 4
    with pytest.raises(ValueError, match="power of two"):
        AllocatorConfig(roundup_power2_divisions=3)
    with pytest.raises(ValueError, match="free of 7"):
        replay([("free", 7, 0)])


def test_snapshot_replay_reads_device_traces_and_live_segments():
    # the format torch.cuda.memory._snapshot() returns: live blocks in segments, then the trace
    snapshot = {
        "segments": [
            {
                "address": 1000,
                "total_size": 2 * MiB,
                "blocks": [
                    {"size": 4096, "requested_size": 4000, "state": "active_allocated"},
                    {"size": 2 * MiB - 4096, "requested_size": 0, "state": "inactive"},
                ],
            }
        ],
        "device_traces": [
            [
                {"action": "segment_alloc", "addr": 5000, "size": 20 * MiB, "stream": 0},
                {"action": "alloc", "addr": 5000, "size": 3 * MiB, "stream": 0},
                {"action": "alloc", "addr": 9000, "size": 11 * MiB, "stream": 0},
                {"action": "free_requested", "addr": 5000, "size": 3 * MiB, "stream": 0},
                {"action": "free_completed", "addr": 5000, "size": 3 * MiB, "stream": 0},
                {"action": "alloc", "addr": 5000, "size": 2 * MiB, "stream": 0},
            ]
        ],
    }
    r = replay_snapshot(snapshot)
    # 4000 B in the small pool (2 MiB); 3 MiB splits a 20 MiB segment and 11 MiB its 17 MiB
    # rest; the 2 MiB after the free takes the 3 MiB block whole (a 1 MiB rest is not split)
    assert r.peak_reserved == 2 * MiB + 20 * MiB
    assert r.peak_allocated == 4096 + 3 * MiB + 11 * MiB
    assert r.allocated == 4096 + 3 * MiB + 11 * MiB
