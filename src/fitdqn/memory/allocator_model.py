"""A model of PyTorch's CUDA caching allocator, to get the bytes a CUDA graph's private pool reserves.

The tracer (``trace.trace_step_memory(..., record_events=True)``) gives the ordered allocations and frees
of one training step (``StepTrace.events``). When the trainer captures that step in a CUDA graph, every one
of those allocations is served from the graph's private pool, frees inside the capture return blocks to
that pool (later allocations of the same capture reuse them), and at the end of capture the pool keeps all
the memory it mapped or cudaMalloc'd until the graph dies: that is the graph's pool. It is more than the
step's live peak because of segment sizes, block rounding and fragmentation. ``replay_events`` runs the
log through ``CachingAllocatorModel`` and ``pool_usage`` gives the pool's reserved bytes.

Rules modelled, read in ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``) of pytorch/pytorch
at two revisions (an older one, and a newer one whose ``ExpandableSegment`` takes an optional stream); torch
2.11's own file was not at hand, so ``tests/memory/test_allocator_model.py`` (GPU part) and
``benchmarks/graph_pool_check.py`` compare with a real pool. Each rule names the function it comes from:

- ``round_size``: a request is rounded up to a multiple of 512 bytes (``kMinBlockSize``), 512 at least.
  The optional ``roundup_power2_divisions`` setting is not modelled (off by default).
- ``get_pool``: requests of 1 MiB or less (``kSmallSize``) go to the small pool, larger ones to the large
  pool; during a capture both are the capture's private pool's own small and large ``BlockPool``.
- ``get_free_block``: best fit: the free block of the pool (and stream) with the smallest size that holds
  the request, ties broken by the lower address (``BlockComparatorSize`` orders by stream, size, address).
  With the default ``max_split_size`` (unlimited) the oversize-block checks never apply.
  With expandable segments one more rule: a block's "expandable size" is its size plus the unmapped
  address space after it; walking up from the best fit, the allocator moves on to the next larger block
  while that one's expandable size is smaller. In effect the free block at the mapped end of a segment
  (which could grow) is taken only when no other free block fits.
- ``get_allocation_size`` (default allocator): a new segment is 2 MiB (``kSmallBuffer``) for the small
  pool, 20 MiB (``kLargeBuffer``) for requests under 10 MiB (``kMinLargeAlloc``), else the request rounded
  up to 2 MiB (``kRoundLarge``). ``alloc_block`` cudaMallocs it as one free block.
- ``should_split``: the block found is split when the rest is worth keeping: small pool, or any pool with
  expandable segments on, when the rest is at least 512 bytes; large pool of the default allocator when the
  rest is over 1 MiB (and the request under ``max_split_size``, unlimited by default). Otherwise the
  request gets the whole block (``memory_allocated`` then counts the whole block).
- ``alloc_found_block``: the split keeps the front for the request; the rest stays free in the pool.
- ``free_block`` / ``try_merge_blocks``: a freed block merges with free neighbours of its segment.
- Expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``; Note [Expandable Segments],
  ``find_expandable_block``, ``map_block``, ``try_allocate_expandable_block``, ``ExpandableSegment``): one
  segment per pool and stream, a large reserved address range of which only a prefix is mapped. Pages are
  2 MiB for the small pool and 20 MiB for the large pool (``segment_size = is_small ? kSmallBuffer :
  kLargeBuffer``). When no free block fits, the segment grows at its mapped end: the free block at the end
  (if any) plus as many new pages as the request still lacks; the request's own size, not
  ``get_allocation_size``, is what is mapped for. Pages are unmapped only by ``empty_cache`` /
  ``release_cached_blocks`` (never during a capture, and never from a live graph's pool). In the newer
  revision ``alloc_block`` uses expandable segments for private pools too; the older one kept private
  pools on cudaMalloc ("our checkpointing logic for private pools doesn't support the
  expandable_segments_ structure yet") while ``should_split`` already followed the global setting.
- One stream: a capture allocates on its capture stream only, so stream ordering and cross-stream
  ``record_stream`` events (deferred frees) are not modelled.
- ``alloc_block``'s memory-fraction check (only when ``torch.cuda.set_per_process_memory_fraction`` or the
  ``per_process_memory_fraction`` alloc-conf key sets ``allowed_memory_maximum``): before growing a segment
  (or cudaMalloc'ing one) the allocator refuses when ``total_allocated_memory + p.alloc_size >
  allowed_memory_maximum``, ``p.alloc_size`` being ``get_allocation_size`` of the request, *not* the pages
  ``try_allocate_expandable_block`` would map. ``total_allocated_memory`` is every byte mapped or
  cudaMalloc'd by the process's allocator (all pools, streams and graphs). So with expandable segments a
  growth that reuses the free block at the mapped end is charged for that block a second time: the cap
  must leave ``reserved before the growth + get_allocation_size(request)``, up to a whole free tail block
  more than the pages the growth maps. Outside a capture a refusal is followed by ``release_cached_blocks``
  (unmaps the free pages of the default pools and of pools no live graph uses) and one retry; during a
  capture nothing is released: the capture OOMs. ``charged_peak_bytes`` is the largest such charge of this
  pool; ``limit_bytes``/``outside_bytes`` make the model raise ``AllocatorCapExceeded`` as the allocator
  would. A real card's limit is physical (``cuMemCreate`` of the pages actually mapped), so this applies to
  fraction-capped processes only; under a cap the trainer maps the update graph's pool before capturing it
  (``fitdqn.device.graphs``), so the capture does not grow it.

Not in the log, so not in the model: what libraries take through the allocator outside ATen ops' outputs,
chiefly the cuBLAS/cuBLASLt workspace a capture stream gets at its first matmul if nothing warmed that
stream up (``overhead.cuda_overhead_component`` budgets one per stream), and kernel scratch beyond what
``kernel_scratch`` models.

In expandable mode where each allocation lands does not depend on the page size (the free block at the
mapped end is taken last either way, and growing puts the request at the same address), so the pool's
bytes are its high-water end rounded up to whole pages: ``PoolUsage.footprint_bytes`` is that end (as if
pages were 512 bytes) and ``reserved_bytes`` the rounded figure. For a step made of many tensors (the
learner's) the footprint beyond the live peak grows nearly linearly with the batch from a few thousand
samples on; the page rounding jumps by up to a page per pool.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from fitdqn.device.probe import ALLOCATOR_CONFIG
from fitdqn.memory.live_bytes import BLOCK_BYTES, AllocEvent, round_block
from fitdqn.memory.trace import StepTrace, line_above

MIB = 1 << 20
MIN_BLOCK = BLOCK_BYTES  # kMinBlockSize
SMALL_SIZE = MIB  # kSmallSize: the largest small-pool request
SMALL_BUFFER = 2 * MIB  # kSmallBuffer: small-pool segment, and expandable small-pool page
LARGE_BUFFER = 20 * MIB  # kLargeBuffer: segment for 1-10 MiB requests, and expandable large-pool page
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc
ROUND_LARGE = 2 * MIB  # kRoundLarge
ADDRESS_SPACE = 1 << 48  # an expandable segment's reserved virtual range: far more than any pool maps


def round_size(nbytes: int) -> int:
    """``round_size``: a multiple of 512 bytes, at least 512 (the tracer's ``round_block``, but never 0)."""
    return max(MIN_BLOCK, round_block(nbytes))


def allocation_size(size: int) -> int:
    """``get_allocation_size``: bytes the default allocator cudaMallocs for a (rounded) request it cannot
    serve from its cache."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class Block:
    """A run of bytes in a segment, free or allocated; ``prev``/``next`` are its neighbours there."""

    segment: Segment
    address: int
    size: int
    allocated: bool = False
    requested: int = 0  # the rounded request it serves (<= size when it was not split)
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)

    @property
    def end(self) -> int:
        return self.address + self.size


@dataclass(eq=False)
class Segment:
    """One cudaMalloc (``size`` fixed) or one expandable segment (``size`` = bytes mapped so far)."""

    pool: BlockPool
    base: int
    size: int
    expandable: bool
    page: int = 0  # expandable only: bytes mapped at a time
    high_water: int = 0  # highest end of an allocated block, relative to ``base``
    tail: Block | None = field(default=None, repr=False)  # the block at the mapped end

    @property
    def end(self) -> int:
        return self.base + self.size


class BlockPool:
    """The free blocks of one pool (small or large), ordered by (size, address) like ``BlockPool.blocks``."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[int, Block] = {}  # address -> free block
        self.segments: list[Segment] = []

    def insert(self, block: Block) -> None:
        bisect.insort(self.keys, (block.size, block.address))
        self.blocks[block.address] = block

    def remove(self, block: Block) -> None:
        index = bisect.bisect_left(self.keys, (block.size, block.address))
        if index == len(self.keys) or self.keys[index] != (block.size, block.address):
            raise AssertionError("free block missing from its pool")
        del self.keys[index]
        del self.blocks[block.address]

    def fitting(self, size: int) -> Iterator[Block]:
        """Free blocks of at least ``size`` bytes, smallest first, then lowest address."""
        for index in range(bisect.bisect_left(self.keys, (size, -1)), len(self.keys)):
            yield self.blocks[self.keys[index][1]]

    @property
    def expandable_segment(self) -> Segment | None:
        return next((segment for segment in self.segments if segment.expandable), None)


def expandable_size(block: Block) -> int:
    """``get_free_block``'s expandable size: the block plus the unmapped range after it, if it ends its
    segment's mapped part."""
    segment = block.segment
    if segment.expandable and block is segment.tail:
        return block.size + ADDRESS_SPACE - segment.size
    return block.size


class AllocatorCapExceeded(MemoryError):
    """``alloc_block`` refused a growth: ``outside + pool reserved + get_allocation_size > limit``."""


class CachingAllocatorModel:
    """One stream's view of ``DeviceCachingAllocator`` (the module docstring lists the rules).

    ``malloc(nbytes) -> Block`` and ``free(block)``; ``reserved_bytes`` is what ``memory_reserved`` would
    count for this model (segments cudaMalloc'd plus pages mapped); nothing is ever given back, as in a
    graph's private pool during and after capture. ``page_bytes`` (small, large) overrides the expandable
    page sizes (2 and 20 MiB), e.g. to check that the layout does not depend on them.

    ``limit_bytes`` (``allowed_memory_maximum``) and ``outside_bytes`` (mapped by other pools when the log
    starts, e.g. the default pool and other graphs' pools at capture) turn on ``alloc_block``'s fraction
    check: a growth with ``outside + reserved + get_allocation_size(size) > limit`` raises
    ``AllocatorCapExceeded`` (no release and retry: the model is a capture's pool).
    """

    def __init__(self, expandable: bool = False, page_bytes: tuple[int, int] | None = None,
                 limit_bytes: int | None = None, outside_bytes: int = 0) -> None:
        self.expandable = expandable
        self.limit_bytes = limit_bytes
        self.outside_bytes = outside_bytes
        self.charged_peak_bytes = 0  # max over growths of reserved before it + get_allocation_size
        self.small_page, self.large_page = page_bytes or (SMALL_BUFFER, LARGE_BUFFER)
        self.small = BlockPool(small=True)
        self.large = BlockPool(small=False)
        self.reserved_bytes = 0
        self.allocated_bytes = 0  # bytes of allocated blocks (what memory_allocated counts)
        self.peak_allocated_bytes = 0
        self.requested_bytes = 0  # rounded request sizes of live allocations
        self.peak_requested_bytes = 0
        self.allocations = 0
        self._next_base = 1 << 40  # segment addresses: increasing, far apart

    # -- public -----------------------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> Block:
        size = round_size(nbytes)
        pool = self.small if size <= SMALL_SIZE else self.large
        block = self._free_block(pool, size)
        if block is not None:
            pool.remove(block)
        else:
            self._check_fraction(size)
            block = self._grow(pool, size) if self.expandable else self._new_segment(pool, size)
        if self._should_split(pool, block, size):
            self._split(pool, block, size)
        block.allocated = True
        block.requested = size
        segment = block.segment
        segment.high_water = max(segment.high_water, block.end - segment.base)
        self.allocations += 1
        self.allocated_bytes += block.size
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        self.requested_bytes += size
        self.peak_requested_bytes = max(self.peak_requested_bytes, self.requested_bytes)
        return block

    def free(self, block: Block) -> None:
        if not block.allocated:
            raise ValueError("block freed twice")
        block.allocated = False
        self.allocated_bytes -= block.size
        self.requested_bytes -= block.requested
        pool = block.segment.pool
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._merge(pool, block, neighbour)
        pool.insert(block)

    @property
    def segments(self) -> list[Segment]:
        return [*self.small.segments, *self.large.segments]

    def footprint_bytes(self) -> int:
        """Reserved bytes if expandable segments mapped 512-byte pages: each expandable segment's high-water
        end (cudaMalloc'd segments count whole)."""
        return sum(s.high_water if s.expandable else s.size for s in self.segments)

    # -- the allocator's steps ---------------------------------------------------------------------------
    def _check_fraction(self, size: int) -> None:
        """``alloc_block``: ``total_allocated_memory + get_allocation_size(size) > allowed_memory_maximum``
        refuses, whatever the growth would map (module docstring)."""
        charge = allocation_size(size)
        charged = self.reserved_bytes + charge
        self.charged_peak_bytes = max(self.charged_peak_bytes, charged)
        if self.limit_bytes is not None and self.outside_bytes + charged > self.limit_bytes:
            raise AllocatorCapExceeded(
                f"{self.outside_bytes} B outside + {self.reserved_bytes} B in the pool + get_allocation_size "
                f"{charge} B = {self.outside_bytes + charged} B > allowed {self.limit_bytes} B")

    def _free_block(self, pool: BlockPool, size: int) -> Block | None:
        """``get_free_block``: best fit; with expandable segments, the growable end block last."""
        candidates = pool.fitting(size)
        best = next(candidates, None)
        if best is None or not best.segment.expandable:
            return best
        for candidate in candidates:
            if expandable_size(candidate) >= expandable_size(best):
                break
            best = candidate
        return best

    def _should_split(self, pool: BlockPool, block: Block, size: int) -> bool:
        """``should_split``; its max_split_size condition always holds at the default (unlimited)."""
        remaining = block.size - size
        if pool.small or self.expandable:
            return remaining >= MIN_BLOCK
        return remaining > SMALL_SIZE

    def _split(self, pool: BlockPool, block: Block, size: int) -> None:
        """``alloc_found_block``: the front serves the request, the rest stays free in the pool."""
        rest = Block(block.segment, block.address + size, block.size - size, prev=block, next=block.next)
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        block.size = size
        if block.segment.tail is block:
            block.segment.tail = rest
        pool.insert(rest)

    def _new_segment(self, pool: BlockPool, size: int) -> Block:
        """``alloc_block`` (default allocator): cudaMalloc ``get_allocation_size`` bytes as one block."""
        nbytes = allocation_size(size)
        segment = Segment(pool, self._take_address(nbytes), nbytes, expandable=False)
        block = Block(segment, segment.base, nbytes)
        segment.tail = block
        pool.segments.append(segment)
        self.reserved_bytes += nbytes
        return block

    def _grow(self, pool: BlockPool, size: int) -> Block:
        """``try_allocate_expandable_block``: the free block at the segment's mapped end (if any) plus whole
        new pages after it, as many as the request still lacks; a pool's first request creates its segment
        (``find_expandable_block``)."""
        segment = pool.expandable_segment
        if segment is None:
            page = self.small_page if pool.small else self.large_page
            segment = Segment(pool, self._take_address(ADDRESS_SPACE), 0, expandable=True, page=page)
            pool.segments.append(segment)
        tail = segment.tail
        if tail is not None and not tail.allocated:
            pool.remove(tail)
            block = tail
        else:
            block = Block(segment, segment.end, 0, prev=tail)
            if tail is not None:
                tail.next = block
            segment.tail = block
        mapped = -(-(size - block.size) // segment.page) * segment.page
        segment.size += mapped
        block.size += mapped
        self.reserved_bytes += mapped
        return block

    def _merge(self, pool: BlockPool, block: Block, neighbour: Block) -> None:
        """``try_merge_blocks``: ``block`` absorbs a free neighbour of its segment."""
        pool.remove(neighbour)
        if neighbour is block.prev:
            block.address = neighbour.address
            block.prev = neighbour.prev
            if block.prev is not None:
                block.prev.next = block
        else:
            block.next = neighbour.next
            if block.next is not None:
                block.next.prev = block
            if block.segment.tail is neighbour:
                block.segment.tail = block
        block.size += neighbour.size

    def _take_address(self, nbytes: int) -> int:
        base = self._next_base
        self._next_base += -(-nbytes // LARGE_BUFFER) * LARGE_BUFFER + LARGE_BUFFER
        return base


@dataclass(frozen=True)
class PoolUsage:
    """What replaying one step's allocator requests in a fresh pool leaves reserved."""

    expandable: bool
    reserved_bytes: int  # cudaMalloc'd segments + mapped pages: the graph pool's bytes
    footprint_bytes: int  # the same with 512-byte expandable pages (= reserved for the default allocator)
    charged_bytes: int  # what a fraction cap must leave the pool: max(reserved, reserved before a growth +
    #                    get_allocation_size of its request) (alloc_block's check; module docstring)
    peak_allocated_bytes: int  # highest bytes of allocated blocks (unsplit blocks count whole)
    peak_requested_bytes: int  # highest live bytes requested (rounded to 512): the step's own live peak
    allocations: int
    segments: int


def replay_events(events: Iterable[AllocEvent | tuple[str, int, int]], expandable: bool = True,
                  page_bytes: tuple[int, int] | None = None) -> PoolUsage:
    """Run an allocation log (``(op, key, nbytes)``, op 'alloc' or 'free') through a fresh pool.

    Frees of keys the log did not allocate (storages made before it) are ignored: their blocks belong to
    another pool. Nothing is released at the end, as in a graph's private pool.
    """
    model = CachingAllocatorModel(expandable, page_bytes)
    live: dict[int, Block] = {}
    for op, key, nbytes in events:
        if op == "alloc":
            if key in live:
                raise ValueError(f"allocation {key} made twice without a free")
            live[key] = model.malloc(nbytes)
        elif op == "free":
            block = live.pop(key, None)
            if block is not None:
                model.free(block)
        else:
            raise ValueError(f"unknown allocator event {op!r}: expected 'alloc' or 'free'")
    return PoolUsage(
        expandable=expandable,
        reserved_bytes=model.reserved_bytes,
        footprint_bytes=model.footprint_bytes(),
        charged_bytes=max(model.reserved_bytes, model.charged_peak_bytes),
        peak_allocated_bytes=model.peak_allocated_bytes,
        peak_requested_bytes=model.peak_requested_bytes,
        allocations=model.allocations,
        segments=len(model.segments),
    )


def pool_usage(trace: StepTrace, expandable: bool = True) -> PoolUsage:
    """``replay_events`` over a traced step's log (traced with ``record_events=True``)."""
    if not trace.events and trace.allocations:
        raise ValueError("this trace has no allocator events: trace it with record_events=True")
    return replay_events(trace.events, expandable)


ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # newer name first: it wins


def expandable_segments_enabled(config: str | None = None) -> bool:
    """Whether the allocator config string ``config`` turns expandable segments on (``...,
    expandable_segments:True,...``). By default the environment's (``PYTORCH_ALLOC_CONF``, else
    ``PYTORCH_CUDA_ALLOC_CONF``), else fitdqn's own default (``device.probe.configure_allocator``), which the
    trainer sets before its first CUDA allocation."""
    if config is None:
        config = next((os.environ[name] for name in ALLOC_CONF_VARIABLES if os.environ.get(name)),
                      ALLOCATOR_CONFIG)
    enabled = False
    for option in config.replace(";", ",").split(","):
        key, _, value = option.partition(":")
        if key.strip() == "expandable_segments":
            enabled = value.strip().lower() == "true"
    return enabled


@dataclass(frozen=True)
class GraphPoolFit:
    """The graph pool beyond the step's live peak, as ``fixed + per_sample x B`` (``pool_line``)."""

    fixed_bytes: int
    per_sample_bytes: int
    expandable: bool
    batches: tuple[int, int]
    usages: tuple[PoolUsage, PoolUsage]

    def bytes_at(self, batch_size: int) -> int:
        return self.fixed_bytes + self.per_sample_bytes * batch_size


def pool_line(points: tuple[tuple[int, int, PoolUsage], tuple[int, int, PoolUsage]], expandable: bool = True
              ) -> GraphPoolFit:
    """The pool beyond the step's live peak as a line through two ``(batch, step_bytes, pool usage)`` points
    (``trace.line_above``: non-negative, above both points).

    With expandable segments the fit is over the pool's footprint (its high-water end, 512-byte pages),
    which grows smoothly with the batch, and the rounding of each pool's mapped end up to whole pages is
    added as one 20 MiB and one 2 MiB page (an upper bound: less than a page each). The default allocator's
    reserved bytes are fitted as they are: they jump with the segment sizes, so that line is rougher.
    """
    ordered = sorted(points, key=lambda p: p[0])
    usages = tuple(usage for _, _, usage in ordered)
    # the pool beyond the step's live peak at each batch (its footprint if expandable)
    extra = tuple((u.footprint_bytes if expandable else u.reserved_bytes) - step for (_, step, u) in ordered)
    batches = (ordered[0][0], ordered[1][0])
    fixed, per_sample = line_above((batches[0], extra[0]), (batches[1], extra[1]))
    fixed += LARGE_BUFFER + SMALL_BUFFER if expandable else 0
    return GraphPoolFit(fixed, per_sample, expandable, batches, usages)  # type: ignore[arg-type]
