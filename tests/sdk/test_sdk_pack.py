"""Weight packing's planner (torpor.pack.plan), which needs no torch: where each weight storage
goes in which pack buffer. The packing itself runs on the GPU (tests/test_pack_gpu.py)."""

from __future__ import annotations

import itertools
import random
import sys

import pytest
from torpor.pack import (
    ALIGN,
    GRANULE,
    MIN_PACK_BYTES,
    Item,
    Packed,
    PackSegment,
    pack_function,
    plan,
)

MiB = 1 << 20


def test_storages_are_placed_in_order_aligned_in_one_pack_of_at_least_20_mib() -> None:
    (p,) = plan([Item("a", 0, 100), Item("b", 0, 1000), Item("c", 0, 3)])
    assert p.device == 0
    assert list(p.offsets.items()) == [("a", 0), ("b", 512), ("c", 1536)]
    assert p.used == 1539 and p.size == MIN_PACK_BYTES


def test_a_storage_seen_twice_is_packed_once() -> None:
    # Tied weights (GPT-2's lm_head and wte) are one storage: one place for both.
    (p,) = plan([Item("wte", 0, 4096), Item("h0", 0, 512), Item("wte", 0, 4096)])
    assert list(p.offsets) == ["wte", "h0"] and p.used == 4096 + 512


def test_empty_storages_and_no_storages_make_no_pack() -> None:
    assert plan([]) == []
    assert plan([Item("empty", 0, 0)]) == []


def test_packs_are_bounded_and_a_storage_is_never_split() -> None:
    items = [Item(i, 0, 100 * MiB) for i in range(5)]
    packs = plan(items, max_pack_bytes=256 * MiB)
    assert [list(p.offsets.items()) for p in packs] == [
        [(0, 0), (1, 100 * MiB)],
        [(2, 0), (3, 100 * MiB)],
        [(4, 0)],
    ]
    assert [p.size for p in packs] == [200 * MiB, 200 * MiB, 100 * MiB]


def test_a_storage_over_the_bound_gets_a_pack_of_its_own() -> None:
    big = 300 * MiB + 1
    packs = plan(
        [Item("small", 0, MiB), Item("big", 0, big), Item("after", 0, MiB)],
        max_pack_bytes=256 * MiB,
    )
    assert [list(p.offsets) for p in packs] == [["small"], ["big"], ["after"]]
    assert packs[1].used == big and packs[1].size == 302 * MiB  # whole 2 MiB granules


def test_each_device_has_its_own_packs() -> None:
    packs = plan([Item("a", 0, 10), Item("b", 1, 10), Item("c", 0, 10)])
    assert [(p.device, list(p.offsets)) for p in packs] == [(0, ["a", "c"]), (1, ["b"])]


def test_every_plan_fits_whole_granules_without_overlap() -> None:
    rng = random.Random(7)
    sizes = [rng.choice([2, 6, 512, 4096, 3 * MiB + 5, 40 * MiB, 150 * MiB, 600 * MiB]) for _ in range(200)]
    items = [Item(i, i % 3, n) for i, n in enumerate(sizes)]
    packs = plan(items, max_pack_bytes=256 * MiB)
    placed = [k for p in packs for k in p.offsets]
    assert sorted(placed) == list(range(len(items)))  # each storage exactly once
    for p in packs:
        assert p.size % GRANULE == 0 and p.size >= max(MIN_PACK_BYTES, p.used), p
        spans = sorted((off, off + sizes[k]) for k, off in p.offsets.items())
        assert all(off % ALIGN == 0 for off, _ in spans), p
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans)), p
        assert spans[-1][1] == p.used
        # Over the bound only as a storage alone in its pack.
        assert p.used <= 256 * MiB or len(spans) == 1, p
        assert all(items[k].device == p.device for k in p.offsets)


@pytest.mark.parametrize("bad", [0, 10 * MiB, 21 * MiB, 255 * MiB + 1, True, 2.0**28])
def test_a_bound_that_is_not_whole_granules_of_at_least_20_mib_is_refused(
    bad: object,
) -> None:
    with pytest.raises(ValueError, match="max_pack_bytes must be a multiple of 2097152 bytes"):
        plan([Item("a", 0, 1)], max_pack_bytes=bad)  # type: ignore[arg-type]


def test_a_negative_size_is_refused() -> None:
    with pytest.raises(ValueError, match="storage 'a' has a negative size"):
        plan([Item("a", 0, -1)])


def test_the_ready_frame_summary() -> None:
    packed = Packed(
        tensors=5,
        storages=4,
        segments=(
            PackSegment(0, 0x7F0000000000, 20 * MiB, 3 * MiB),
            PackSegment(0, 0x7F0001400000, 22 * MiB, 21 * MiB),
        ),
        whole=True,
        left_bytes=0,
        seconds=0.25,
    )
    assert packed.bytes == 24 * MiB
    assert packed.frame() == {
        "tensors": 5,
        "storages": 4,
        "segments": 2,
        "bytes": 24 * MiB,
        "segment_bytes": 42 * MiB,
        "whole": True,
        "left_bytes": 0,
        "s": 0.25,
    }


def test_without_torch_there_is_nothing_to_pack() -> None:
    if "torch" in sys.modules:
        pytest.skip("torch is imported in this process")
    assert pack_function(object()) is None
