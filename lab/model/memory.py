"""GPU memory of one worker: weights, then a KV region served first-fit in fixed blocks.

Each request needs one contiguous allocation for its KV cache, as a naive serving process with a
caching allocator does. Requests of mixed sizes freed out of order leave holes, so an allocation
can fail although the free memory in total would hold it: "fits, yet fails on fragmented
memory". Paged KV caches (vLLM) avoid this; the lab models the servers that do not.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

MIB = 1024 * 1024
BLOCK_BYTES = 2 * MIB  # allocation granularity (the PyTorch caching allocator's large-block size)


@dataclass(frozen=True, slots=True)
class Allocation:
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


class KvRegion:
    """First-fit allocator over ``capacity_bytes``; holes kept sorted by position."""

    def __init__(self, capacity_bytes: int) -> None:
        self.total_blocks = max(0, capacity_bytes // BLOCK_BYTES)
        self._holes: list[tuple[int, int]] = [(0, self.total_blocks)] if self.total_blocks else []
        self.used_blocks = 0
        self.failures_total = 0
        self.fragmented_failures_total = 0

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * BLOCK_BYTES

    @property
    def free_bytes(self) -> int:
        return (self.total_blocks - self.used_blocks) * BLOCK_BYTES

    @property
    def largest_hole_bytes(self) -> int:
        return max((size for _, size in self._holes), default=0) * BLOCK_BYTES

    def allocate(self, nbytes: int) -> Allocation:
        blocks = max(1, -(-nbytes // BLOCK_BYTES))
        for i, (start, size) in enumerate(self._holes):
            if size >= blocks:
                if size == blocks:
                    del self._holes[i]
                else:
                    self._holes[i] = (start + blocks, size - blocks)
                self.used_blocks += blocks
                return Allocation(start, blocks)
        error = AllocationFailed(blocks * BLOCK_BYTES, self.free_bytes, self.largest_hole_bytes)
        self.failures_total += 1
        self.fragmented_failures_total += error.fragmented
        raise error

    def free(self, allocation: Allocation) -> None:
        start, blocks = allocation.start_block, allocation.blocks
        i = bisect.bisect_left(self._holes, (start, 0))
        # merge with the hole before and after, so freed neighbours become one hole again
        if i > 0 and self._holes[i - 1][0] + self._holes[i - 1][1] == start:
            i -= 1
            start, blocks = self._holes[i][0], self._holes[i][1] + blocks
            del self._holes[i]
        if i < len(self._holes) and start + blocks == self._holes[i][0]:
            blocks += self._holes[i][1]
            del self._holes[i]
        self._holes.insert(i, (start, blocks))
        self.used_blocks -= allocation.blocks
