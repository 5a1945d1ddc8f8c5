"""Paged KV-cache block manager with prefix caching (vLLM v1 / nano-vllm style).

The KV cache is split into ``num_blocks`` fixed-size blocks of ``block_size`` token slots. This
module owns only block ids and bookkeeping, never tensors. Each request has a block table: token
position ``p`` lives in ``table[p // block_size]``, slot ``p % block_size``.

A full block whose tokens are all computed can be registered under a chained hash (its own tokens
plus the hash of the block before it), so a later request with the same prefix can reuse it. The
hash is a digest of bytes, equal in every process (unlike ``hash()``), so a prefill server and a
decode server agree on which blocks hold a prefix.
Freed blocks keep their hash while they wait in the free queue; they are evicted (hash cleared)
only when the allocator hands them out again, least recently freed first.

A window pool (thermostat.engine.kv_blocks) is a BlockManager whose tables start with
placeholders: positions whose blocks were released (`release`) or never held (`allocate` with
`skip`), since nothing reads them any more.

| table entry | meaning                                                      |
|-------------|--------------------------------------------------------------|
| >= 0        | a block id; the table holds one reference                    |
| PLACEHOLDER | (-1) no block: released or skipped; only at the table's head |
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BLOCK_HASH_BYTES = 16
PLACEHOLDER = -1  # a table position without a block
_ROOT_HASH = bytes(BLOCK_HASH_BYTES)  # the parent of a sequence's first block


def hash_block_tokens(parent_hash: bytes | None, tokens: Sequence[int]) -> bytes:
    """Chained hash of one FULL block, the same in every process and on every machine.

    ``blake2b(parent_hash + tokens as little-endian int64, digest_size=16)``; the first block's
    parent (``None``) counts as 16 zero bytes.
    """
    data = (parent_hash or _ROOT_HASH) + struct.pack(f"<{len(tokens)}q", *tokens)
    return hashlib.blake2b(data, digest_size=BLOCK_HASH_BYTES).digest()


def compute_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Hashes of every full block of ``token_ids``, chained from the first block.

    A partial trailing block gets no hash.
    """
    hashes: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass
class Block:
    """One KV-cache block: its id, how many request tables hold it, and its prefix-cache hash."""

    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full and registered in the prefix cache


class BlockManager:
    """Allocates KV-cache blocks to requests and shares full blocks through a prefix cache.

    Invariants (checked by :meth:`check_integrity`):
    - ``ref_count`` of a block == number of request tables that contain it (at most once each);
    - placeholders form a prefix of a table;
    - the free queue holds exactly the blocks with ``ref_count == 0``: a freed block that caches
      nothing at the front (handed out next: its memory is already written, where a block never
      used yet faults its pages in), a cached one at the end (the least recently freed evicted
      first);
    - ``_hash_to_block[h] == b`` iff ``blocks[b].hash == h`` (a hash names at most one block).
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        # Free queue, front = next to be handed out. OrderedDict gives O(1) removal on revival.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[bytes, int] = {}
        self._tables: dict[str, list[int]] = {}
        self.prefix_cache_queries = 0  # in blocks
        self.prefix_cache_hits = 0  # in blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0, including cached-but-unreferenced (evictable) ones."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks with ref_count > 0."""
        return 1.0 - len(self._free) / self.num_blocks

    def block_table(self, req_id: str) -> list[int]:
        """A copy of the request's block table; ``[]`` for an unknown request."""
        return list(self._tables.get(req_id, ()))

    def table_length(self, req_id: str) -> int:
        """Positions in the request's table, placeholders included."""
        return len(self._tables.get(req_id, ()))

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` slots: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    def lookup(self, block_hashes: list[bytes]) -> list[int]:
        """Block ids of the longest cached prefix of ``block_hashes``. Changes no ref counts.

        Returns ``[]`` when prefix caching is disabled (and then counts nothing).
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for h in block_hashes:
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        self.prefix_cache_queries += len(block_hashes)
        self.prefix_cache_hits += len(hits)
        return hits

    def lookup_range(self, block_hashes: list[bytes], start: int) -> list[int] | None:
        """Block ids of ``block_hashes[start:]`` if every one is cached, else None. Counts
        nothing (a window pool's check of a hit the main pool counted)."""
        if not self.enable_prefix_caching:
            return [] if start >= len(block_hashes) else None
        found = [self._hash_to_block.get(h) for h in block_hashes[start:]]
        return None if None in found else [b for b in found if b is not None]

    def can_allocate(
        self,
        req_id: str,
        num_tokens: int,
        computed_blocks: list[int] | None = None,
        skip: int = 0,
    ) -> bool:
        """Whether :meth:`allocate` with these arguments would succeed (changes nothing)."""
        table = self._tables.get(req_id, [])
        computed = computed_blocks or []
        if computed or skip:
            if table:
                raise ValueError(
                    f"request {req_id!r} already has blocks; cannot attach cached ones"
                )
            if len(set(computed)) != len(computed):
                raise ValueError("computed_blocks contains duplicates")
            for b in computed:
                if not 0 <= b < self.num_blocks or self.blocks[b].hash is None:
                    raise ValueError(f"block {b} is not a cached block")
        held = len(table) + skip + len(computed)
        num_new = max(0, self.num_blocks_needed(num_tokens) - held)
        # Reviving a cached free block takes it out of the free queue, so it is not available twice.
        num_revived = sum(1 for b in computed if self.blocks[b].ref_count == 0)
        return num_new <= len(self._free) - num_revived

    def allocate(
        self,
        req_id: str,
        num_tokens: int,
        computed_blocks: list[int] | None = None,
        skip: int = 0,
    ) -> bool:
        """Make ``req_id``'s table cover ``num_tokens`` slots; False, changing nothing, if short.

        A request with no table yet may start with ``skip`` placeholders, then ``computed_blocks``
        (from :meth:`lookup` / :meth:`lookup_range`) for the positions after them. Fresh blocks
        come from the front of the free queue; handing out a block that still carries a hash
        evicts it from the prefix cache.
        """
        if not self.can_allocate(req_id, num_tokens, computed_blocks, skip):
            return False  # nothing has been mutated: failure is atomic
        table = self._tables.get(req_id, []) + [PLACEHOLDER] * skip
        computed = computed_blocks or []
        num_new = max(0, self.num_blocks_needed(num_tokens) - len(table) - len(computed))
        for b in computed:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self._free[b]
            block.ref_count += 1
            table.append(b)
        for _ in range(num_new):
            b, _ = self._free.popitem(last=False)
            block = self.blocks[b]
            if block.hash is not None:  # evict: the slots are about to be overwritten
                del self._hash_to_block[block.hash]
                block.hash = None
            block.ref_count = 1
            table.append(b)
        self._tables[req_id] = table
        return True

    def free(self, req_id: str) -> None:
        """Release the request's blocks; an unknown id is a no-op.

        Blocks reaching ref_count 0 join the free queue in reverse table order: cached ones at
        its end, so a sequence's tail is evicted before its head (they stay in the prefix cache
        until evicted), the others at its front.
        """
        self._unref(reversed(self._tables.pop(req_id, [])))

    def release(self, req_id: str, up_to_block: int) -> None:
        """Drop the request's blocks at table positions below ``up_to_block`` (placeholders
        take their place); they join the free queue, cached ones stay cached (evictable)."""
        table = self._tables.get(req_id)
        if table is None:
            return
        end = min(up_to_block, len(table))
        released = table[:end]
        table[:end] = [PLACEHOLDER] * end
        self._unref(reversed(released))

    def _unref(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            if b == PLACEHOLDER:
                continue
            block = self.blocks[b]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[b] = None
                if block.hash is None:
                    self._free.move_to_end(b, last=False)

    def cache_blocks(self, req_id: str, block_hashes: list[bytes], start: int = 0) -> None:
        """Register the request's blocks at positions [start, len(block_hashes)) in the prefix
        cache (placeholders skipped).

        The caller passes hashes only for full, fully computed blocks. Already-hashed blocks are
        skipped; if another block already holds a hash, that mapping wins and this block stays
        unhashed. No-op when prefix caching is disabled.
        """
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(req_id, [])
        if len(block_hashes) > len(table):
            raise ValueError(f"{len(block_hashes)} hashes for {len(table)} blocks of {req_id!r}")
        for b, h in zip(table[start:], block_hashes[start:], strict=False):
            if b == PLACEHOLDER:
                continue
            block = self.blocks[b]
            if block.hash is not None or h in self._hash_to_block:
                continue
            block.hash = h
            self._hash_to_block[h] = b

    def reset_prefix_cache(self) -> int:
        """Forget the hashes of all unreferenced blocks (referenced ones keep theirs); return
        how many were forgotten."""
        dropped = 0
        for b in self._free:
            block = self.blocks[b]
            if block.hash is not None:
                del self._hash_to_block[block.hash]
                block.hash = None
                dropped += 1
        return dropped

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant, if any."""

        def require(cond: bool, msg: str) -> None:
            if not cond:
                raise AssertionError(msg)

        require(len(self.blocks) == self.num_blocks, "block count: wrong number of blocks")
        for i, block in enumerate(self.blocks):
            require(block.block_id == i, f"block ids: position {i} holds block {block.block_id}")
        refs: Counter[int] = Counter()
        for req_id, full_table in self._tables.items():
            table = [b for b in full_table if b != PLACEHOLDER]
            head = full_table[: len(full_table) - len(table)]
            require(all(b == PLACEHOLDER for b in head), f"tables: {req_id!r} has a late hole")
            require(len(set(table)) == len(table), f"tables: {req_id!r} holds a block twice")
            require(all(0 <= b < self.num_blocks for b in table), f"tables: bad id in {req_id!r}")
            refs.update(table)
        for block in self.blocks:
            b = block.block_id
            msg = f"ref_count: block {b} has {block.ref_count}, tables hold it {refs[b]} times"
            require(block.ref_count == refs[b], msg)
        expected_free = {block.block_id for block in self.blocks if block.ref_count == 0}
        require(set(self._free) == expected_free, "free queue: != blocks with ref_count 0")
        carried = [(block.hash, block.block_id) for block in self.blocks if block.hash is not None]
        same = dict(carried) == self._hash_to_block and len(carried) == len(self._hash_to_block)
        require(same, "hash map: != the hashes the blocks carry")
        require(self.enable_prefix_caching or not self._hash_to_block, "hash map: caching is off")
        require(
            self.num_free_blocks + len(refs) == self.num_blocks, "accounting: free + used != all"
        )
