"""The KV block pool's bookkeeping (no torch): which blocks are free, which hold a named prefix.

The device memory is runtime.kv_cache.PagedCache: `blocks` blocks of `block_size` positions.
Here a block is an id with a reference count. A full block of a sequence can be named by a hash
chain of its tokens (the hash of the blocks before it and its own token ids, salted with the
model): a later sequence whose tokens begin the same way reuses those blocks instead of computing
them again (prefix caching). A named block nobody holds stays cached until its memory is needed,
then the least recently used goes first. Block 0 (kv_cache.NULL_BLOCK) is never handed out.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict


def chain(tokens: list[int], block_size: int, salt: bytes = b"", parent: bytes | None = None,
          start: int = 0) -> list[bytes]:
    """The names of the full blocks of tokens[start:] (start: a multiple of block_size, parent: the
    name of the block before it, None at 0)."""
    names, h = [], parent if parent is not None else hashlib.sha256(salt).digest()
    for i in range(start, len(tokens) - block_size + 1, block_size):
        block = tokens[i : i + block_size]
        h = hashlib.sha256(h + b"".join(t.to_bytes(4, "little", signed=True) for t in block)).digest()
        names.append(h)
    return names


class BlockPool:
    """Ids 1..blocks-1 with reference counts; named blocks kept for reuse (LRU) once unreferenced.
    Counters for /metrics: hit_tokens / queried_tokens (prefix lookups), evicted."""

    def __init__(self, blocks: int, block_size: int, prefix_cache: bool = True, salt: bytes = b""):
        if blocks < 2:
            raise ValueError(f"a block pool needs 2+ blocks, not {blocks}")
        self.blocks, self.block_size, self.prefix_cache, self.salt = blocks, block_size, prefix_cache, salt
        self._free = list(range(blocks - 1, 0, -1))  # never named, or named no more; pop() takes the lowest
        self._refs = [0] * blocks
        self._name_of: dict[int, bytes] = {}
        self._by_name: dict[bytes, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # named, unreferenced: oldest use first
        self.hit_tokens = self.queried_tokens = self.evicted = 0

    @property
    def available(self) -> int:
        """Blocks an allocation can take now (free, or cached and unreferenced)."""
        return len(self._free) + len(self._idle)

    @property
    def used(self) -> int:
        """Blocks some sequence holds."""
        return self.blocks - 1 - self.available

    @property
    def cached(self) -> int:
        """Named blocks (held or idle)."""
        return len(self._by_name)

    def allocate(self, n: int) -> list[int]:
        """n blocks for one sequence (referenced once); the caller checked `available`."""
        if n > self.available:
            raise RuntimeError(f"{n} KV blocks asked, {self.available} available")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:  # the least recently used cached block: its name goes
                b, _ = self._idle.popitem(last=False)
                del self._by_name[self._name_of.pop(b)]
                self.evicted += 1
            self._refs[b] = 1
            out.append(b)
        return out

    def release(self, ids: list[int]) -> None:
        """A sequence lets its blocks go: named ones stay cached (the last one released is the most
        recently used), the others are free."""
        for b in reversed(ids):  # a sequence's first blocks are the likeliest to be shared: evicted last
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._name_of:
                    self._idle[b] = None
                    self._idle.move_to_end(b)
                else:
                    self._free.append(b)

    def match(self, names: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `names` (a sequence's block names, its first
        first); nothing is held yet (hold)."""
        out = []
        for h in names if self.prefix_cache else []:
            b = self._by_name.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def idle(self, block: int) -> bool:
        """Whether a cached block is unreferenced (an allocation may evict it)."""
        return block in self._idle

    def hold(self, ids: list[int]) -> None:
        """Reference cached blocks (match's) for one more sequence."""
        for b in ids:
            if self._refs[b] == 0:
                del self._idle[b]
            self._refs[b] += 1

    def count(self, queried: int, hit: int) -> None:
        """A prefix lookup for /metrics: `queried` tokens, `hit` of them cached."""
        self.queried_tokens += queried
        self.hit_tokens += hit

    def name(self, block: int, h: bytes) -> None:
        """Block `block` (held, full, its K/V computed or on their way) is the prefix named h. A name
        already held by another block keeps that one."""
        if not self.prefix_cache or block in self._name_of or h in self._by_name:
            return
        self._name_of[block] = h
        self._by_name[h] = block
