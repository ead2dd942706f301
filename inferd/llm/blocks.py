"""The KV cache's blocks: who holds each, and which full blocks can be reused.

The allocator only counts and hands out block numbers; it never decides who waits or
who is preempted when blocks run out -- it returns ``None`` and the scheduler owns
that policy.

Prefix caching (as vLLM's): a block whose tokens are all computed gets a *key*, a hash
of its tokens chained to the key of the block before it (and salted with the LoRA
adapter that computed it), so equal keys mean equal keys and values. Blocks are counted
by reference: sequences with the same prefix share its blocks, and a block no sequence
holds any more stays in the cache, reusable, until it is needed for something else.
Free blocks are handed out oldest-freed first, and a sequence's blocks are freed from
its last to its first, so the ends of prompts go before their common beginnings.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


def block_key(parent: bytes, tokens: list[int], salt: bytes = b"") -> bytes:
    """The key of a full block of ``tokens`` following the block keyed ``parent`` (b""
    for the first). 128 bits of BLAKE2b: a prompt cannot be made to collide with
    another tenant's prefix and read its keys and values."""
    return hashlib.blake2b(parent + salt + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        """Blocks no sequence holds, the next to hand out first (cached ones included)."""
        self._key_of: dict[int, bytes] = {}
        self._cached: dict[bytes, int] = {}
        """Key -> a block holding it, held or not."""
        self.references = 0
        """Holds of blocks by sequences, all told (a shared block counts once per holder)."""

    @property
    def free_count(self) -> int:
        """Blocks no sequence holds (some may hold a cached prefix until reused)."""
        return len(self._free)

    @property
    def used_count(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def cached_count(self) -> int:
        """Blocks with a key (held or reusable)."""
        return len(self._cached)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        taken = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            key = self._key_of.pop(block, None)
            if key is not None:
                del self._cached[key]
            self._refs[block] = 1
            taken.append(block)
        self.references += n
        return taken

    def free(self, blocks: list[int]) -> None:
        refs = self._refs
        self.references -= len(blocks)
        for block in reversed(blocks):
            refs[block] -= 1
            if refs[block] == 0:
                self._free[block] = None

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The blocks of the longest run of ``keys`` (a sequence's first blocks) that the
        cache holds, each now held once more by the caller."""
        found = []
        for key in keys:
            block = self._cached.get(key)
            if block is None:
                break
            found.append(block)
        refs = self._refs
        for block in found:
            if refs[block] == 0:
                del self._free[block]
            refs[block] += 1
        self.references += len(found)
        return found

    def register(self, block: int, key: bytes) -> None:
        """``block`` (held, its tokens all computed) holds ``key``; where another block
        already does (two sequences computed the same prefix at once), that one stays."""
        if key not in self._cached and block not in self._key_of:
            self._cached[key] = block
            self._key_of[block] = key

    def holds(self, block: int) -> int:
        """How many sequences hold ``block``."""
        return self._refs[block]


def blocks_needed(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)
