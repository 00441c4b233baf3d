"""GPU memory of one worker: its KV region, managed as a caching allocator manages it.

Like PyTorch's caching allocator, the region reserves memory from the device in segments and
carves each request's KV block (one contiguous allocation) best-fit out of a segment; a freed
block goes back to its own segment, and segments are kept, not given back. After requests of
mixed sizes the reserved memory is cut into holes no larger than the requests that made them, so
a larger request fails once the unreserved rest is too small, although the free memory in
total would hold it: "fits, yet fails on fragmented memory". NVML sees the reserved memory as
used. Paged KV caches (vLLM) avoid the holes; the lab models the servers that do not.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIB = 1024 * 1024
BLOCK_BYTES = 2 * MIB  # allocation granularity (the caching allocator's large-block rounding)
MIN_SEGMENT_BLOCKS = 10  # a new segment is at least 20 MiB, as PyTorch's large pool rounds


@dataclass(frozen=True, slots=True)
class Allocation:
    segment: int
    start_block: int
    blocks: int

    @property
    def bytes(self) -> int:
        return self.blocks * BLOCK_BYTES


class AllocationFailed(Exception):
    def __init__(self, wanted_bytes: int, free_bytes: int, largest_free_bytes: int) -> None:
        self.wanted_bytes = wanted_bytes
        self.free_bytes = free_bytes
        self.largest_free_bytes = largest_free_bytes
        self.fragmented = free_bytes >= wanted_bytes
        kind = "fragmented" if self.fragmented else "out of memory"
        super().__init__(
            f"{kind}: wanted {wanted_bytes / MIB:.0f} MiB, free {free_bytes / MIB:.0f} MiB, "
            f"largest hole {largest_free_bytes / MIB:.0f} MiB"
        )


@dataclass
class _Segment:
    blocks: int
    holes: list[tuple[int, int]] = field(default_factory=list)  # (start, size), by start


class KvRegion:
    def __init__(self, capacity_bytes: int) -> None:
        self.total_blocks = max(0, capacity_bytes // BLOCK_BYTES)
        self.unreserved_blocks = self.total_blocks
        self.segments: list[_Segment] = []
        self.used_blocks = 0
        self.failures_total = 0
        self.fragmented_failures_total = 0

    @property
    def used_bytes(self) -> int:
        """Held by requests now."""
        return self.used_blocks * BLOCK_BYTES

    @property
    def reserved_bytes(self) -> int:
        """Taken from the device (what NVML counts as used)."""
        return (self.total_blocks - self.unreserved_blocks) * BLOCK_BYTES

    @property
    def free_bytes(self) -> int:
        return (self.total_blocks - self.used_blocks) * BLOCK_BYTES

    @property
    def largest_hole_bytes(self) -> int:
        cached = max((size for s in self.segments for _, size in s.holes), default=0)
        return max(cached, self.unreserved_blocks) * BLOCK_BYTES

    def allocate(self, nbytes: int) -> Allocation:
        blocks = max(1, -(-nbytes // BLOCK_BYTES))
        best: tuple[int, int, int] | None = None  # (size, segment, hole index)
        for s, segment in enumerate(self.segments):
            for i, (_, size) in enumerate(segment.holes):
                if size >= blocks and (best is None or size < best[0]):
                    best = (size, s, i)
        if best is None:
            if blocks > self.unreserved_blocks:
                error = AllocationFailed(
                    blocks * BLOCK_BYTES, self.free_bytes, self.largest_hole_bytes
                )
                self.failures_total += 1
                self.fragmented_failures_total += error.fragmented
                raise error
            size = min(max(blocks, MIN_SEGMENT_BLOCKS), self.unreserved_blocks)
            self.unreserved_blocks -= size
            self.segments.append(_Segment(size, [(0, size)]))
            best = (size, len(self.segments) - 1, 0)
        _, s, i = best
        holes = self.segments[s].holes
        start, size = holes[i]
        if size == blocks:
            del holes[i]
        else:
            holes[i] = (start + blocks, size - blocks)
        self.used_blocks += blocks
        return Allocation(s, start, blocks)

    def free(self, allocation: Allocation) -> None:
        holes = self.segments[allocation.segment].holes
        start, blocks = allocation.start_block, allocation.blocks
        i = bisect.bisect_left(holes, (start, 0))
        # merge with the holes before and after within the segment
        if i > 0 and holes[i - 1][0] + holes[i - 1][1] == start:
            i -= 1
            start, blocks = holes[i][0], holes[i][1] + blocks
            del holes[i]
        if i < len(holes) and start + blocks == holes[i][0]:
            blocks += holes[i][1]
            del holes[i]
        holes.insert(i, (start, blocks))
        self.used_blocks -= allocation.blocks
