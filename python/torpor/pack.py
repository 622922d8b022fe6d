"""Weight packing: a function's CUDA parameters and buffers moved into segments of their own.

The daemon shares a cuda segment read-only between instances only when PyTorch's caching
allocator shows nothing in it but the function's weights (torpor.shareable, docs/split.md
"Read-only segments"). Models as they are loaded rarely satisfy that: a checkpoint read tensor by
tensor leaves weights in 20 MiB segments beside free tails, small weights share 2 MiB segments
with whatever else was small, so nothing is shared and every instance copies all weights.

After the function's setup() (before its warm-up request), when CUDA allocations are segments of
the device-memory hook, the harness copies every weight into *pack buffers* and re-points the
tensors at them, then frees the old blocks. Each pack buffer is one allocator segment holding
nothing else, for as long as the weights live, so each is shareable once the warm-up leaves it
unchanged.

Why a pack buffer is a whole segment (c10/cuda/CUDACachingAllocator.cpp): a request of at least
kMinLargeAlloc (10 MiB) that no cached free block serves becomes a cudaMalloc of the request
rounded up to kRoundLarge (2 MiB) (get_allocation_size), and a block of the exact request size
is not split (should_split: nothing remains). So a request that is a multiple of 2 MiB and at
least 20 MiB (kLargeBuffer, a margin over the 10 MiB rule) gets a segment of exactly its size,
one block and no free tail. A cached free block can still serve it (and would be split, leaving
a free tail beside the weights): the packer empties the cache first, and holds on to any
allocation that `torch.cuda.memory_snapshot()` does not show as a whole segment (so that free
block is taken) and asks again.

Packing order is module registration order (each submodule's own parameters, then its buffers),
so the segments follow the order a forward pass mostly reads them in, and several bounded packs
(at most 256 MiB each; a storage larger than that gets a pack of its own and is never split)
let the restore server fill them one after another while the first modules already run.

What moves is whole storages: tied weights (one Parameter, or two tensors on one storage) are
copied once and every tensor viewing the storage is re-pointed with its own offset, size and
stride (`tensor.data = view`, as Module.to() does), so non-contiguous views stay views. Each
storage starts 512-byte aligned (the allocator's own block alignment), so kernels see the same
alignment and compute bit-identical results. A tensor that is not a dense CUDA tensor (CPU,
sparse, quantized, a subclass, an inference tensor) is left where it is; so is a tensor the
function holds directly, outside its modules, and one over memory PyTorch's allocator did not
give (platform-managed GPU data viewed by torpor.load_tensors, DLPack or CUDA-array imports):
that memory is not the allocator's to free, so a copy would only hold the weights twice (and,
for platform data, undo a start that copies nothing). A setup() that captured CUDA graphs is
not packed (the graphs would read the old addresses).

The planner (`plan`) is pure Python; the rest needs torch, imported by the function.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from torpor.mempool import GATE, pool_key, possible_captures
from torpor.shareable import modules_of

ENV_HOOK_CUDA = "TORPOR_HOOK_CUDA"  # "1": the hook backs CUDA allocations with segments
GRANULE = 2 << 20  # kRoundLarge: cudaMalloc sizes of large blocks are multiples of it
MIN_PACK_BYTES = 20 << 20  # kLargeBuffer; anything >= kMinLargeAlloc (10 MiB) gets its own segment
ALIGN = 512  # kMinBlockSize: the alignment the allocator gives every block
DEFAULT_MAX_PACK_BYTES = 256 << 20
# How long packing waits for the sandbox's other pool work to pause (AllocatorGate).
GATE_WAIT_S = 2.0
# How many allocations that landed in an existing segment's free block are held before giving up.
_MAX_PLACEHOLDERS = 16


class PackError(Exception):
    """Packing could not put the weights into whole segments; they stay where they were."""


@dataclass(frozen=True)
class Item:
    """One storage to pack: `key` names it (each key is packed once), `nbytes` its size."""

    key: Hashable
    device: int
    nbytes: int


@dataclass
class PackPlan:
    """One pack buffer: `size` bytes to allocate (whole granules, at least MIN_PACK_BYTES),
    `used` of them taken by the storages at `offsets` (each ALIGN-aligned, in packing order)."""

    device: int
    size: int = 0
    used: int = 0
    offsets: dict[Hashable, int] = field(default_factory=dict)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def plan(items: Iterable[Item], max_pack_bytes: int = DEFAULT_MAX_PACK_BYTES) -> list[PackPlan]:
    """Place each storage (in order, each key once, empty ones skipped) into pack buffers per
    device, filling one until the next storage would take it past `max_pack_bytes`. A storage
    larger than that gets a pack of its own. Packs come in the order they were opened."""
    if (
        isinstance(max_pack_bytes, bool)
        or not isinstance(max_pack_bytes, int)
        or max_pack_bytes < MIN_PACK_BYTES
        or max_pack_bytes % GRANULE
    ):
        raise ValueError(
            f"max_pack_bytes must be a multiple of {GRANULE} bytes (2 MiB) and at least "
            f"{MIN_PACK_BYTES} (20 MiB), got {max_pack_bytes!r}"
        )
    packs: list[PackPlan] = []
    open_pack: dict[int, PackPlan] = {}
    seen: set[Hashable] = set()
    for item in items:
        if item.nbytes < 0:
            raise ValueError(f"storage {item.key!r} has a negative size ({item.nbytes})")
        if item.key in seen or item.nbytes == 0:
            continue
        seen.add(item.key)
        pack = open_pack.get(item.device)
        offset = 0 if pack is None else _round_up(pack.used, ALIGN)
        if pack is None or (pack.used and offset + item.nbytes > max_pack_bytes):
            pack = open_pack[item.device] = PackPlan(item.device)
            packs.append(pack)
            offset = 0
        pack.offsets[item.key] = offset
        pack.used = offset + item.nbytes
    for pack in packs:
        pack.size = max(MIN_PACK_BYTES, _round_up(pack.used, GRANULE))
    return packs


@dataclass(frozen=True)
class PackSegment:
    device: int
    va: int
    size: int
    used: int


@dataclass(frozen=True)
class Packed:
    """What packing did."""

    tensors: int  # parameters and buffers re-pointed
    storages: int  # distinct storages copied
    segments: tuple[PackSegment, ...]
    whole: bool  # every pack buffer was one whole allocator segment when packing ended
    left_bytes: int  # bytes of old storages something else still holds (not freed)
    seconds: float

    @property
    def bytes(self) -> int:
        return sum(s.used for s in self.segments)

    def frame(self) -> dict[str, Any]:
        """The `packed` field of the worker's `ready` frame (docs/split.md)."""
        return {
            "tensors": self.tensors,
            "storages": self.storages,
            "segments": len(self.segments),
            "bytes": self.bytes,
            "segment_bytes": sum(s.size for s in self.segments),
            "whole": self.whole,
            "left_bytes": self.left_bytes,
            "s": round(self.seconds, 6),
        }


def _weights(torch: Any, modules: list[Any]) -> Iterator[Any]:
    """Every dense CUDA parameter and buffer of `modules`, each once, in registration order."""
    seen: set[int] = set()
    for top in modules:
        for module in top.modules():
            for t in (
                *module.parameters(recurse=False),
                *module.buffers(recurse=False),
            ):
                if id(t) in seen:
                    continue
                seen.add(id(t))
                if (
                    type(t) in (torch.Tensor, torch.nn.Parameter)
                    and t.device.type == "cuda"
                    and t.layout == torch.strided
                    and not t.is_quantized
                    # Made under torch.inference_mode(): .data cannot be set outside it.
                    and not t.is_inference()
                ):
                    yield t


@dataclass
class _Storage:
    storage: Any
    tensors: list[Any]


def _group(torch: Any, modules: list[Any]) -> dict[tuple[int, int], _Storage]:
    """The weights of `modules` by storage, keyed (device, storage address), in packing order.
    (A function of its own so that no loop variable keeps an old storage alive afterwards.)"""
    groups: dict[tuple[int, int], _Storage] = {}
    for t in _weights(torch, modules):
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            continue
        key = (t.device.index, storage.data_ptr())
        group = groups.get(key)
        if group is None:
            groups[key] = group = _Storage(storage, [])
        group.tensors.append(t)
    return groups


def _segment_of(snapshot: list[dict[str, Any]], ptr: int) -> dict[str, Any] | None:
    """The segment of `torch.cuda.memory_snapshot()` holding address `ptr`."""
    for segment in snapshot:
        start = int(segment["address"])
        if start <= ptr < start + int(segment["total_size"]):
            return segment
    return None


def _own_segment(snapshot: list[dict[str, Any]], ptr: int) -> int | None:
    """The size of the allocator segment that starts at `ptr` and is one block (the allocation
    at `ptr`), else None. (The size can exceed the request where the allocator's config rounds
    block sizes up, e.g. roundup_power2_divisions; the segment is still the pack's alone.)"""
    segment = _segment_of(snapshot, ptr)
    if segment is None or int(segment["address"]) != ptr or len(segment.get("blocks", [])) != 1:
        return None
    return int(segment["total_size"])


def _whole_segment(torch: Any, size: int, device: int) -> tuple[Any, int]:
    """A uint8 CUDA tensor of `size` bytes that is a whole allocator segment of its own, and the
    segment's size."""
    torch.cuda.empty_cache()  # no wholly free cached segment left for the request to split
    held: list[Any] = []  # allocations that landed in a free block of a segment in use
    for _ in range(_MAX_PLACEHOLDERS):
        buf = torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", device))
        snapshot = torch.cuda.memory_snapshot()
        segment_size = _own_segment(snapshot, buf.data_ptr())
        if segment_size is not None:
            return buf, segment_size
        segment = _segment_of(snapshot, buf.data_ptr())
        if segment is not None and segment.get("is_expandable"):
            raise PackError(
                "PyTorch's expandable_segments is on, so no allocation is a segment of its own; "
                "leave PYTORCH_CUDA_ALLOC_CONF's expandable_segments off (the hook needs it off too)"
            )
        held.append(buf)
    raise PackError(
        f"{_MAX_PLACEHOLDERS} allocations of {size} bytes on cuda:{device} all landed in free blocks of "
        "segments in use; the allocator's cache is too fragmented to pack into whole segments"
    )


def _move(torch: Any, group: _Storage, dest: Any, storage: Any, offset: int) -> None:
    """Copy `group`'s storage into `dest` (a uint8 tensor over `storage`) at byte `offset` and
    re-point each tensor viewing it at the same place in `storage`."""
    nbytes = group.storage.nbytes()
    src = torch.empty(0, dtype=torch.uint8, device=dest.device).set_(group.storage)
    dest[offset : offset + nbytes].copy_(src)
    for t in group.tensors:
        # ALIGN is a multiple of every element size, so the offset is whole elements.
        elements = offset // t.element_size() + t.storage_offset()
        view = torch.empty(0, dtype=t.dtype, device=dest.device).set_(storage, elements, t.size(), t.stride())
        t.data = view


def _weak_ref(storage: Any) -> Any:
    """A weak reference to `storage` (None where this torch has none): packing checks that the
    old storages went, so that the weights are not held twice."""
    try:
        from torch.multiprocessing.reductions import StorageWeakRef  # type: ignore[import-not-found, unused-ignore]

        return StorageWeakRef(storage)
    except Exception:
        return None


def pack_function(
    function: Any, max_pack_bytes: int = DEFAULT_MAX_PACK_BYTES, name: str | None = None
) -> Packed | None:
    """Pack the CUDA parameters and buffers of the modules `function` holds (torpor.shareable's
    modules_of). None when there is nothing to pack: torch not imported, CUDA not initialised,
    no module, or no weight on CUDA in memory the allocator gave. Raises PackError (the weights
    stay correct where each one is) when the allocator cannot give whole segments. `name` is
    the function's in a sandbox: the private pools the harness made for its other functions
    (torpor.mempool.possible_captures) do not stop the packing."""
    torch: Any = sys.modules.get("torch")
    if torch is None or function is None or not torch.cuda.is_initialized():
        return None
    if torch.cuda.get_allocator_backend() != "native":
        raise PackError(
            f"PyTorch's CUDA allocator is {torch.cuda.get_allocator_backend()}, whose memory the hook "
            "cannot see; use the native caching allocator (PYTORCH_CUDA_ALLOC_CONF without backend:)"
        )
    # Packing empties the cache and reads the allocator's snapshot, neither of which may run
    # beside another thread's pool work (torpor.mempool.AllocatorGate): in a sandbox it runs
    # while no other function's request, capture or release does (waiting a little for one to
    # end), and holds new ones back until it is done.
    with GATE.exclusive_within(GATE_WAIT_S) as quiet:
        if not quiet:
            raise PackError(
                f"another thread of this sandbox kept using PyTorch's memory pools (a request, a graph "
                f"capture or an idle release) for {GATE_WAIT_S:g} s, and packing cannot run beside it; "
                "the weights stay where setup() put them"
            )
        return _pack(torch, function, max_pack_bytes, name)


def _pack(torch: Any, function: Any, max_pack_bytes: int, name: str | None) -> Packed | None:
    t0 = time.perf_counter()
    groups = _group(torch, modules_of(function))
    if not groups:
        return None
    allocator = torch.cuda.memory_snapshot()
    pools = {pool_key(s.get("segment_pool_id", (0, 0))) for s in allocator} - {(0, 0)}
    graphs = possible_captures(pools, name)
    if graphs:
        # A CUDA graph captured in setup() replays with the addresses the weights had then.
        raise PackError(
            f"setup() allocated from {len(graphs)} private memory pool(s) (CUDA graphs or torch.cuda.MemPool), "
            "and a captured graph would go on reading the weights' old addresses; capture graphs in the "
            "warm-up request instead, or set [gpu] pack_weights = false"
        )
    # Storages outside every allocator segment are not the allocator's: left where they are.
    for outside in [k for k in groups if _segment_of(allocator, k[1]) is None]:
        del groups[outside]
    del allocator
    if not groups:
        return None
    tensors = sum(len(g.tensors) for g in groups.values())
    packs = plan((Item(k, k[0], g.storage.nbytes()) for k, g in groups.items()), max_pack_bytes)
    old = [(_weak_ref(g.storage), g.storage.nbytes()) for g in groups.values()]
    storages = len(groups)
    segments: list[PackSegment] = []
    with torch.no_grad():
        for p in packs:
            with torch.cuda.device(p.device):
                dest, segment_size = _whole_segment(torch, p.size, p.device)
                storage = dest.untyped_storage()
                for key, offset in p.offsets.items():
                    _move(torch, groups.pop(cast(tuple[int, int], key)), dest, storage, offset)
                segments.append(PackSegment(p.device, dest.data_ptr(), segment_size, p.used))
                del dest, storage
    # Old storages that only a reference cycle still holds (model loaders leave some) go now,
    # before the cache is emptied and before left_bytes is counted.
    gc.collect()
    # The old blocks are free now: give their segments back, so the hook releases them (the
    # gate is held: see pack_function).
    for device in sorted({s.device for s in segments}):
        with torch.cuda.device(device):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    snapshot = torch.cuda.memory_snapshot()
    whole = all(_own_segment(snapshot, s.va) == s.size for s in segments)
    # An old storage still alive is held by something outside the modules (a tensor the
    # function keeps elsewhere): that tensor still reads the old copy, and the weights use twice
    # the memory.
    left = sum(n for ref, n in old if ref is not None and not ref.expired())
    return Packed(tensors, storages, tuple(segments), whole, left, time.perf_counter() - t0)
