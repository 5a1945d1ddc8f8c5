"""Tests for the paged KV-cache block manager and its prefix cache."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from thermostat.engine.block_manager import (
    Block,
    BlockManager,
    compute_block_hashes,
    hash_block_tokens,
)

BS = 4  # block size for the example-based tests
OTHER = hash_block_tokens(None, [-1] * BS)  # a hash no test registers


def snapshot(bm: BlockManager) -> dict:
    """Every piece of manager state, deep-copied, for before/after comparisons."""
    return copy.deepcopy(
        {
            "blocks": [(b.block_id, b.ref_count, b.hash) for b in bm.blocks],
            "free": list(bm._free),
            "hash_map": dict(bm._hash_to_block),
            "tables": {k: list(v) for k, v in bm._tables.items()},
            "stats": (bm.prefix_cache_queries, bm.prefix_cache_hits),
        }
    )


def free_order(bm: BlockManager) -> list[int]:
    return list(bm._free)


# --- hashing -----------------------------------------------------------------------------------


def test_compute_block_hashes_ignores_partial_block() -> None:
    tokens = list(range(10))
    hashes = compute_block_hashes(tokens, BS)
    assert len(hashes) == 2
    assert hashes == compute_block_hashes(tokens[:8], BS)
    assert compute_block_hashes(tokens[:3], BS) == []
    assert compute_block_hashes([], BS) == []


def test_compute_block_hashes_is_chained() -> None:
    a = [1, 2, 3, 4, 9, 9, 9, 9]
    b = [5, 6, 7, 8, 9, 9, 9, 9]
    ha, hb = compute_block_hashes(a, BS), compute_block_hashes(b, BS)
    # Same tokens in block 1, different parents: different hashes.
    assert ha[1] != hb[1]
    assert ha[0] == hash_block_tokens(None, [1, 2, 3, 4])
    assert ha[1] == hash_block_tokens(ha[0], [9, 9, 9, 9])
    # A shared prefix gives shared leading hashes.
    assert compute_block_hashes(a + [0] * 4, BS)[:2] == ha


def test_hash_depends_on_parent_and_on_every_token() -> None:
    tokens = [1, 2, 3, 4]
    root = hash_block_tokens(None, tokens)
    assert isinstance(root, bytes) and len(root) == 16
    assert hash_block_tokens(None, tokens) == root
    assert hash_block_tokens(root, tokens) != root
    assert hash_block_tokens(OTHER, tokens) != hash_block_tokens(root, tokens)
    assert hash_block_tokens(None, [1, 2, 4, 3]) != root
    # Token ids are packed as int64: large ids and their low bytes do not collide.
    assert hash_block_tokens(None, [1 + 2**32, 2, 3, 4]) != root


def test_hash_is_the_same_in_every_process() -> None:
    """Prefill and decode servers run in different processes: Python's hash() differs there
    (string hashing is seeded per process), a block hash must not."""
    code = (
        "from thermostat.engine.block_manager import compute_block_hashes;"
        "print([h.hex() for h in compute_block_hashes(list(range(100, 140)), 16)])"
    )
    outputs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            cwd=Path(__file__).resolve().parents[1],  # this checkout's package
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        outputs.append(proc.stdout)
    expected = str([h.hex() for h in compute_block_hashes(list(range(100, 140)), 16)])
    assert outputs == [expected + "\n"] * 2


# --- allocation ----------------------------------------------------------------------------------


def test_initial_state() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    assert bm.num_free_blocks == 6
    assert bm.usage == 0.0
    assert free_order(bm) == list(range(6))
    assert bm.block_table("nope") == []
    assert [bm.num_blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    bm.check_integrity()


def test_allocate_free_round_trip() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    assert bm.allocate("a", 10)
    assert bm.block_table("a") == [0, 1, 2]
    assert [bm.blocks[b].ref_count for b in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    bm.check_integrity()
    bm.free("a")
    assert bm.block_table("a") == []
    assert bm.num_free_blocks == 8
    assert bm.usage == 0.0
    # Freed blocks that cache nothing are handed out next (their pages are already written).
    assert free_order(bm) == [0, 1, 2, 3, 4, 5, 6, 7]
    bm.check_integrity()
    bm.free("a")  # unknown / already freed: no-op
    assert bm.num_free_blocks == 8


def test_freed_blocks_that_cache_nothing_are_reused_before_fresh_or_cached_ones() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    assert bm.allocate("a", 10)  # blocks 0, 1 full (cached below), 2 partial
    bm.cache_blocks("a", compute_block_hashes(list(range(10)), BS))
    bm.free("a")
    # the partial block's pages are written: next; never-used blocks; the cache's, tail first
    assert free_order(bm) == [2, 3, 4, 5, 6, 7, 1, 0]
    assert bm.allocate("b", 4)
    assert bm.block_table("b") == [2]
    assert len(bm.lookup(compute_block_hashes(list(range(8)), BS))) == 2  # still cached
    bm.check_integrity()


def test_allocate_grows_table_for_decode() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    assert bm.allocate("a", 3)
    assert bm.block_table("a") == [0]
    assert bm.allocate("a", 4)  # still fits in block 0
    assert bm.block_table("a") == [0]
    assert bm.allocate("b", 1)
    assert bm.allocate("a", 5)  # crosses into a new block
    assert bm.block_table("a") == [0, 2]
    assert bm.allocate("a", 2)  # shrinking never frees
    assert bm.block_table("a") == [0, 2]
    assert bm.allocate("a", 13)
    assert bm.block_table("a") == [0, 2, 3, 4]
    bm.check_integrity()


def test_allocate_failure_is_atomic() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    assert bm.allocate("a", 8)
    bm.cache_blocks("a", compute_block_hashes(list(range(8)), BS))
    bm.free("a")
    assert bm.allocate("b", 4)
    # 3 free blocks; "c" reviving 2 cached ones and needing 2 more would need 4.
    cached = bm.lookup(compute_block_hashes(list(range(8)), BS))
    assert len(cached) == 2
    before = snapshot(bm)  # lookup only changed the stats
    assert not bm.allocate("c", 16, computed_blocks=cached)
    assert snapshot(bm) == before
    assert not bm.allocate("b", 4 + 4 * 4)  # growth beyond capacity
    assert snapshot(bm) == before
    assert not bm.allocate("d", 17)
    assert snapshot(bm) == before
    assert bm.block_table("d") == []
    bm.check_integrity()
    assert bm.allocate("c", 12, computed_blocks=cached)  # exactly fits
    assert bm.num_free_blocks == 0
    bm.check_integrity()


def test_computed_blocks_only_for_new_requests() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    assert bm.allocate("a", 4)
    bm.cache_blocks("a", compute_block_hashes([1, 2, 3, 4], BS))
    with pytest.raises(ValueError):
        bm.allocate("a", 8, computed_blocks=[0])
    with pytest.raises(ValueError):
        bm.allocate("b", 8, computed_blocks=[1])  # not a cached block
    bm.check_integrity()


# --- prefix caching ------------------------------------------------------------------------------


def test_prefix_sharing_and_revival() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS)
    tokens_a = list(range(14))  # 3 full blocks + 2 tokens
    hashes_a = compute_block_hashes(tokens_a, BS)
    assert len(hashes_a) == 3
    assert bm.lookup(hashes_a) == []
    assert bm.allocate("a", len(tokens_a))
    table_a = bm.block_table("a")
    bm.cache_blocks("a", hashes_a)
    assert [bm.blocks[b].hash for b in table_a] == [*hashes_a, None]
    bm.check_integrity()

    # B shares A's first two blocks, then diverges.
    tokens_b = tokens_a[:8] + [99] * 6
    hashes_b = compute_block_hashes(tokens_b, BS)
    hit = bm.lookup(hashes_b)
    assert hit == table_a[:2]
    assert bm.allocate("b", len(tokens_b), computed_blocks=hit)
    table_b = bm.block_table("b")
    assert table_b[:2] == table_a[:2]
    assert not set(table_b[2:]) & set(table_a)
    assert [bm.blocks[b].ref_count for b in table_a[:2]] == [2, 2]
    assert bm.usage == pytest.approx(6 / 10)
    bm.check_integrity()

    # A finishes: shared blocks survive with B's reference; A's own blocks keep their hashes.
    bm.free("a")
    assert [bm.blocks[b].ref_count for b in table_a] == [1, 1, 0, 0]
    assert bm.blocks[table_a[2]].hash == hashes_a[2]
    assert bm.lookup(hashes_a) == table_a[:3]
    bm.check_integrity()

    # C revives A's freed-but-cached third block out of the free queue.
    free_before = bm.num_free_blocks
    assert bm.allocate("c", 12, computed_blocks=bm.lookup(hashes_a))
    assert bm.block_table("c") == table_a[:3]
    assert table_a[2] not in bm._free
    assert bm.num_free_blocks == free_before - 1
    assert [bm.blocks[b].ref_count for b in table_a[:3]] == [2, 2, 1]
    bm.check_integrity()

    assert bm.prefix_cache_queries == 3 + 3 + 3 + 3
    assert bm.prefix_cache_hits == 0 + 2 + 3 + 3


def test_lookup_returns_longest_cached_prefix_only() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    hashes = compute_block_hashes(list(range(12)), BS)
    assert bm.allocate("a", 12)
    bm.cache_blocks("a", hashes)
    assert bm.lookup(hashes) == [0, 1, 2]
    assert bm.lookup([hashes[0], OTHER, hashes[2]]) == [0]  # stops at the first miss
    assert bm.lookup([OTHER, *hashes]) == []
    assert bm.lookup([]) == []
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (3 + 3 + 4, 3 + 1)


def test_cache_blocks_skips_hashed_and_duplicate_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    tokens = [7] * 8
    hashes = compute_block_hashes(tokens, BS)
    assert bm.allocate("a", 8) and bm.allocate("b", 8)
    bm.cache_blocks("a", hashes[:1])
    bm.cache_blocks("a", hashes)  # block 0 already hashed: skipped, block 1 registered
    assert bm.block_table("a") == [0, 1]
    assert bm._hash_to_block == {hashes[0]: 0, hashes[1]: 1}
    # B computed the same content independently: existing mapping wins, B's blocks stay unhashed.
    bm.cache_blocks("b", hashes)
    assert [bm.blocks[b].hash for b in bm.block_table("b")] == [None, None]
    assert bm.lookup(hashes) == [0, 1]
    with pytest.raises(ValueError):
        bm.cache_blocks("a", [*hashes, OTHER])
    bm.check_integrity()


def test_eviction_reuses_cached_blocks_and_drops_hashes() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    tokens = list(range(16))
    hashes = compute_block_hashes(tokens, BS)
    assert bm.allocate("a", 16)
    bm.cache_blocks("a", hashes)
    bm.free("a")
    assert bm.num_free_blocks == 4  # cached blocks still count as free
    assert bm.lookup(hashes) == [0, 1, 2, 3]
    # Fill the whole pool with unrelated content: every cached block is evicted.
    assert bm.allocate("b", 16)
    assert sorted(bm.block_table("b")) == [0, 1, 2, 3]
    assert all(b.hash is None for b in bm.blocks)
    assert bm._hash_to_block == {}
    assert bm.lookup(hashes) == []
    bm.check_integrity()


def test_eviction_is_lru_tail_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    tokens = list(range(12))
    hashes = compute_block_hashes(tokens, BS)
    assert bm.allocate("a", 12)
    bm.cache_blocks("a", hashes)
    bm.free("a")
    # Free queue: never-used 3, 4, 5 first, then A's blocks tail first: 2, 1, 0.
    assert free_order(bm) == [3, 4, 5, 2, 1, 0]
    assert bm.allocate("x", 16)  # takes 3, 4, 5 and evicts A's tail block 2
    assert bm.block_table("x") == [3, 4, 5, 2]
    assert bm.blocks[2].hash is None
    assert bm.lookup(hashes) == [0, 1]  # the head of A's prefix is still reusable
    assert bm.allocate("y", 4)  # evicts block 1 next, breaking the chain after block 0
    assert bm.block_table("y") == [1]
    assert bm.lookup(hashes) == [0]
    bm.check_integrity()


def test_reset_prefix_cache_keeps_referenced_hashes() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    ha = compute_block_hashes([1] * 8, BS)
    hb = compute_block_hashes([2] * 8, BS)
    assert bm.allocate("a", 8) and bm.allocate("b", 8)
    bm.cache_blocks("a", ha)
    bm.cache_blocks("b", hb)
    bm.free("a")
    bm.reset_prefix_cache()
    assert bm.lookup(ha) == []
    assert bm.lookup(hb) == bm.block_table("b")
    bm.check_integrity()


def test_disabled_prefix_caching() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=False)
    hashes = compute_block_hashes(list(range(8)), BS)
    assert bm.allocate("a", 8)
    bm.cache_blocks("a", hashes)
    assert all(b.hash is None for b in bm.blocks)
    assert bm.lookup(hashes) == []
    bm.free("a")
    assert bm.lookup(hashes) == []
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)
    bm.check_integrity()


def test_check_integrity_detects_corruption() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    assert bm.allocate("a", 8)
    bm.cache_blocks("a", compute_block_hashes(list(range(8)), BS))
    bm.check_integrity()

    broken = copy.deepcopy(bm)
    broken.blocks[0].ref_count = 2
    with pytest.raises(AssertionError, match="ref_count"):
        broken.check_integrity()

    broken = copy.deepcopy(bm)
    broken._free[0] = None
    with pytest.raises(AssertionError, match="free queue"):
        broken.check_integrity()

    broken = copy.deepcopy(bm)
    broken.blocks[1].hash = OTHER
    with pytest.raises(AssertionError, match="hash map"):
        broken.check_integrity()

    broken = copy.deepcopy(bm)
    broken.blocks[3] = Block(2)
    with pytest.raises(AssertionError, match="block ids"):
        broken.check_integrity()

    broken = copy.deepcopy(bm)
    broken._tables["a"].append(0)
    with pytest.raises(AssertionError, match="tables"):
        broken.check_integrity()


# --- stateful property test ----------------------------------------------------------------------


class BlockManagerMachine(RuleBasedStateMachine):
    """Random add / decode / cache / free sequences over a tiny vocabulary so prefixes collide.

    The model keeps each live request's tokens and, per block registered in the prefix cache, the
    full token prefix it was registered with: a lookup hit must return blocks holding that content.
    """

    @initialize(
        num_blocks=st.integers(2, 12),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.booleans(),
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.tokens: dict[str, list[int]] = {}
        # block id -> token prefix the block's slots hold, known once its request cached it
        self.content: dict[int, tuple[int, ...]] = {}
        self.next_id = 0

    def _expect_allocate(self, req_id: str, num_tokens: int, computed: list[int]) -> bool:
        """Model answer: does the pool have room for this allocation?"""
        table = self.bm.block_table(req_id)
        need = max(0, self.bm.num_blocks_needed(num_tokens) - len(table) - len(computed))
        revived = sum(1 for b in computed if self.bm.blocks[b].ref_count == 0)
        return need <= self.bm.num_free_blocks - revived

    def _overwrite(self, fresh: list[int]) -> None:
        """Fresh blocks get new tokens written into them: their old content is gone."""
        for b in fresh:
            self.content.pop(b, None)

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=20))
    def add_request(self, tokens: list[int]) -> None:
        req_id = f"r{self.next_id}"
        self.next_id += 1
        bs = self.bm.block_size
        hit = self.bm.lookup(compute_block_hashes(tokens, bs))
        for i, b in enumerate(hit):
            assert self.content.get(b) == tuple(tokens[: (i + 1) * bs]), (
                "cache hit with wrong content"
            )
        if not self.bm.enable_prefix_caching:
            assert hit == []
        expected = self._expect_allocate(req_id, len(tokens), hit)
        before = snapshot(self.bm)
        ok = self.bm.allocate(req_id, len(tokens), computed_blocks=hit)
        assert ok == expected
        if ok:
            self.tokens[req_id] = tokens
            table = self.bm.block_table(req_id)
            assert table[: len(hit)] == hit
            self._overwrite(table[len(hit) :])
            assert len(table) == self.bm.num_blocks_needed(len(tokens))
        else:
            assert snapshot(self.bm) == before
            assert self.bm.block_table(req_id) == []

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def decode(self, data: st.DataObject, extra: list[int]) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.tokens)))
        new_len = len(self.tokens[req_id]) + len(extra)
        expected = self._expect_allocate(req_id, new_len, [])
        old_table = self.bm.block_table(req_id)
        before = snapshot(self.bm)
        ok = self.bm.allocate(req_id, new_len)
        assert ok == expected
        if ok:
            self.tokens[req_id] += extra
            table = self.bm.block_table(req_id)
            assert table[: len(old_table)] == old_table
            self._overwrite(table[len(old_table) :])
            assert len(table) == self.bm.num_blocks_needed(new_len)
        else:
            assert snapshot(self.bm) == before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens, bs = self.tokens[req_id], self.bm.block_size
        hashes = compute_block_hashes(tokens, bs)
        self.bm.cache_blocks(req_id, hashes)
        for i, b in enumerate(self.bm.block_table(req_id)[: len(hashes)]):
            if self.bm.blocks[b].hash == hashes[i]:  # registered (now or earlier) under this prefix
                self.content[b] = tuple(tokens[: (i + 1) * bs])
        if self.bm.enable_prefix_caching:
            # Every full block is now findable (via this request's block or an equal one).
            assert len(self.bm.lookup(hashes)) == len(hashes)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.tokens)))
        table = self.bm.block_table(req_id)
        self.bm.free(req_id)
        del self.tokens[req_id]
        released = [b for b in reversed(table) if self.bm.blocks[b].ref_count == 0]
        cached = [b for b in released if self.bm.blocks[b].hash is not None]
        written = [b for b in released if self.bm.blocks[b].hash is None]
        order = free_order(self.bm)
        if cached:  # at the end, the table's tail first
            assert order[-len(cached) :] == cached
        assert order[: len(written)] == written[::-1]  # at the front, each before the last
        assert self.bm.block_table(req_id) == []

    @rule()
    def reset_prefix_cache(self) -> None:
        self.bm.reset_prefix_cache()
        assert all(self.bm.blocks[b].hash is None for b in self.bm._free)

    @invariant()
    def integrity(self) -> None:
        self.bm.check_integrity()
        referenced = {b for req_id in self.tokens for b in self.bm.block_table(req_id)}
        assert self.bm.num_free_blocks + len(referenced) == self.bm.num_blocks
        assert self.bm.usage == pytest.approx(len(referenced) / self.bm.num_blocks)
        for req_id, tokens in self.tokens.items():
            assert len(self.bm.block_table(req_id)) * self.bm.block_size >= len(tokens)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_manager_state_machine = BlockManagerMachine.TestCase
