"""The block pools of one KV cache behind one interface for the scheduler: the main pool (what
grows with the context) and a window pool per distinct component window (rows read only for
the last `window` positions, thermostat.models.kv_spec), each a BlockManager of its own with
the main pool's block size and block hashes. A request has one table per pool, aligned by
position; a window pool's table starts with placeholders where its blocks were released.

| event                     | main pool               | window pool of window w                |
|---------------------------|-------------------------|----------------------------------------|
| admission, C computed     | the hit's blocks, fresh | skip (C - w) // bs, hit blocks, fresh  |
| after a step, C computed  | full blocks cached      | cached too; blocks below (C - w) // bs |
|                           |                         | released (they stay cached, evictable) |
| preemption, finish        | freed                   | freed                                  |

A prefix hit of k blocks is taken only where every window pool still caches the blocks of the
last w positions before k * bs; otherwise the longest shorter k that has them (exact: no hit
lacks state). All-or-nothing across pools: `allocate` changes nothing unless every pool fits.
A request loaded from a handoff holds rows only from C - w on in a window pool: its blocks
before ceil((C - w) / bs) are never cached (they hold unwritten rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from thermostat.engine.block_manager import BlockManager
from thermostat.models.kv_spec import KVCacheSpec


@dataclass(frozen=True)
class PrefixHit:
    """A prefix served by the cache: `num_blocks` main blocks, and per pool the cached blocks
    of positions [first needed, num_blocks) (the main pool's: all of them)."""

    num_blocks: int
    blocks: tuple[list[int], ...]


class KVBlocks:
    """The pools of one cache; `pools[0]` is the main pool (window None)."""

    def __init__(self, pools: Sequence[BlockManager], windows: Sequence[int | None]) -> None:
        if len(pools) != len(windows) or windows[0] is not None or None in windows[1:]:
            raise ValueError(f"pools need the main pool first, got windows {windows}")
        if len({p.block_size for p in pools}) != 1:
            raise ValueError("pools need one block size")
        self.pools = list(pools)
        self.windows = list(windows)
        self._cache_from: dict[str, list[int]] = {}  # handoffs: first cacheable block per pool

    @classmethod
    def for_spec(
        cls, spec: KVCacheSpec, num_blocks: Sequence[int], enable_prefix_caching: bool
    ) -> KVBlocks:
        pools = [BlockManager(n, spec.block_size, enable_prefix_caching) for n in num_blocks]
        return cls(pools, spec.pools)

    @property
    def main(self) -> BlockManager:
        return self.pools[0]

    # ---- the main pool's numbers (what the server reports) ----
    @property
    def block_size(self) -> int:
        return self.main.block_size

    @property
    def num_blocks(self) -> int:
        return self.main.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.main.num_free_blocks

    @property
    def usage(self) -> float:
        return self.main.usage

    @property
    def prefix_cache_queries(self) -> int:
        return self.main.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.main.prefix_cache_hits

    def num_blocks_needed(self, num_tokens: int) -> int:
        return self.main.num_blocks_needed(num_tokens)

    def block_table(self, req_id: str) -> list[int]:
        """The request's main table."""
        return self.main.block_table(req_id)

    def block_tables(self, req_id: str) -> list[list[int]]:
        """The request's table in every pool (PLACEHOLDER at released positions)."""
        return [pool.block_table(req_id) for pool in self.pools]

    def _skip(self, window: int | None, num_computed: int) -> int:
        """Blocks before the first position a step at `num_computed` reads in a pool."""
        return 0 if window is None else max(0, num_computed - window) // self.block_size

    def lookup(self, block_hashes: list[bytes]) -> PrefixHit:
        """The longest cached prefix of `block_hashes` whose window pools hold its state."""
        found = self.main.lookup(block_hashes)
        for k in range(len(found), 0, -1):
            blocks = [found[:k]]
            for pool, window in zip(self.pools[1:], self.windows[1:], strict=True):
                ids = pool.lookup_range(block_hashes[:k], self._skip(window, k * self.block_size))
                if ids is None:
                    break
                blocks.append(ids)
            else:
                self.main.prefix_cache_hits -= len(found) - k  # counted, but not served
                return PrefixHit(k, tuple(blocks))
        self.main.prefix_cache_hits -= len(found)
        return PrefixHit(0, tuple([] for _ in self.pools))

    def allocate(
        self, req_id: str, num_tokens: int, hit: PrefixHit | None = None, num_computed: int = 0
    ) -> bool:
        """Cover `num_tokens` positions in every pool, or change nothing and return False. A
        request without blocks starts from `hit`, or with `num_computed` tokens whose rows it
        gets elsewhere (a handoff): then its window pools skip what no step reads."""
        new = self.main.table_length(req_id) == 0
        if hit is not None:
            num_computed = hit.num_blocks * self.block_size
        plans = []
        for p, (pool, window) in enumerate(zip(self.pools, self.windows, strict=True)):
            computed = hit.blocks[p] if new and hit is not None else []
            skip = self._skip(window, num_computed) if new else 0
            plans.append((pool, computed, skip))
            if not pool.can_allocate(req_id, num_tokens, computed, skip):
                return False
        for pool, computed, skip in plans:
            pool.allocate(req_id, num_tokens, computed, skip)
        if new and hit is None and num_computed and len(self.pools) > 1:
            bs = self.block_size
            self._cache_from[req_id] = [
                0 if w is None else -(-max(0, num_computed - w) // bs) for w in self.windows
            ]
        return True

    def free(self, req_id: str) -> None:
        for pool in self.pools:
            pool.free(req_id)
        self._cache_from.pop(req_id, None)

    def cache_blocks(self, req_id: str, block_hashes: list[bytes]) -> None:
        """Register the request's full, computed blocks (hashes of its first blocks) in every
        pool."""
        starts = self._cache_from.get(req_id, [0] * len(self.pools))
        for pool, start in zip(self.pools, starts, strict=True):
            pool.cache_blocks(req_id, block_hashes, start)

    def release(self, req_id: str, num_computed: int) -> None:
        """Release the window pools' blocks that no step from `num_computed` on reads."""
        for pool, window in zip(self.pools[1:], self.windows[1:], strict=True):
            pool.release(req_id, self._skip(window, num_computed))

    def slots(self, req_id: str, num_tokens: int) -> list[list[int]]:
        """Per pool, the cache slots of the positions of [0, num_tokens) that a step from
        num_tokens on reads: all of them in the main pool, the last `window` in a window pool."""
        bs, out = self.block_size, []
        for pool, window in zip(self.pools, self.windows, strict=True):
            table = pool.block_table(req_id)
            first = 0 if window is None else max(0, num_tokens - window)
            out.append([table[p // bs] * bs + p % bs for p in range(first, num_tokens)])
        return out

    def reset_prefix_cache(self) -> int:
        """Forget every unreferenced block's hash in every pool; how many were forgotten."""
        return sum(pool.reset_prefix_cache() for pool in self.pools)

    def check_integrity(self) -> None:
        """Every pool's invariants, and tables of one length per request in every pool."""
        for pool in self.pools:
            pool.check_integrity()
        for req_id in self.main._tables:
            lengths = {pool.table_length(req_id) for pool in self.pools}
            if len(lengths) != 1:
                raise AssertionError(f"tables: {req_id!r} has tables of lengths {lengths}")


# the main pool holds at most this many times what every running sequence at full length holds
MAIN_POOL_HEADROOM = 2


def size_pools(
    spec: KVCacheSpec,
    memory_bytes: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
) -> list[int]:
    """Blocks per pool. A window pool gets twice what max_num_seqs sequences hold between steps
    (`spec.window_blocks`) plus a prefill chunk (max_num_batched_tokens / bs + max_num_seqs
    blocks), scaled down to half the memory if that is more, but never below what one
    sequence's window and chunk need; the main pool gets the rest, up to twice what
    max_num_seqs sequences of max_model_len tokens hold (`MAIN_POOL_HEADROOM`): memory past that
    would only ever keep old prefixes, and a tiny model's 1 GB would be millions of blocks."""
    bs = spec.block_size
    chunk = -(-max_num_batched_tokens // bs) + max_num_seqs
    wanted, least = [], []
    for window in spec.pools[1:]:
        assert window is not None
        wanted.append(2 * (max_num_seqs * spec.window_blocks(window) + chunk))
        least.append(spec.window_blocks(window + max_num_batched_tokens))
    per_block = [spec.pool_bytes_per_block(p) for p in range(1, len(spec.pools))]
    total = sum(n * b for n, b in zip(wanted, per_block, strict=True))
    scale = min(1.0, memory_bytes / 2 / total) if total else 1.0
    sizes = [max(lo, int(n * scale)) for n, lo in zip(wanted, least, strict=True)]
    used = sum(n * b for n, b in zip(sizes, per_block, strict=True))
    most = MAIN_POOL_HEADROOM * max_num_seqs * -(-max_model_len // bs)
    return [min(spec.num_blocks_for(max(memory_bytes - used, 0)), most), *sizes]
