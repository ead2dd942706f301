"""The free list of KV-cache blocks.

The allocator only counts and hands out block numbers; it never decides who waits or
who is preempted when blocks run out -- it returns ``None`` and the scheduler owns
that policy.
"""

from __future__ import annotations


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        return taken

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


def blocks_needed(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)
