"""Window pools: BlockManager's placeholders, release and range lookups, KVBlocks' prefix hits
across pools, and the scheduler over a main pool and a window pool driven by a toy runner that
reads its window rows from the window pool (so a released, stale or missing window block
changes or breaks the output)."""

from __future__ import annotations

import copy
import zlib
from typing import Any

import pytest

from tests.test_scheduler import BS, prompt, request, step
from thermostat.engine.block_manager import PLACEHOLDER, BlockManager, compute_block_hashes
from thermostat.engine.config import SchedulerConfig
from thermostat.engine.kv_blocks import KVBlocks
from thermostat.engine.scheduler import Scheduler
from thermostat.engine.steps import RunnerOutput, SchedulerOutput

WINDOW = 5  # positions a step reads behind its first new token, in the window pool


def test_release_leaves_placeholders_and_keeps_cached_blocks() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    hashes = compute_block_hashes(list(range(16)), BS)
    assert bm.allocate("a", 16)
    bm.cache_blocks("a", hashes[:3])
    table = bm.block_table("a")
    bm.release("a", 2)
    assert bm.block_table("a") == [PLACEHOLDER, PLACEHOLDER, *table[2:]]
    assert [bm.blocks[b].ref_count for b in table] == [0, 0, 1, 1]
    assert bm.num_free_blocks == 4 and bm.table_length("a") == 4
    assert bm.lookup(hashes[:2]) == table[:2]  # released, still cached (evictable)
    bm.release("a", 1)  # already released: nothing changes
    bm.check_integrity()
    bm.cache_blocks("a", hashes)  # placeholders are skipped
    assert bm.blocks[table[3]].hash == hashes[3]
    assert bm.allocate("b", 8)  # the two never-hashed free blocks first, then the LRU
    assert bm.allocate("c", 4)
    assert bm.block_table("c") == [table[1]]  # released in reverse: the tail evicted first
    assert bm.lookup(hashes[:2]) == [table[0]]
    bm.free("a")
    bm.check_integrity()


def test_range_lookup_and_allocation_after_placeholders() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    hashes = compute_block_hashes(list(range(16)), BS)
    assert bm.allocate("a", 16)
    bm.cache_blocks("a", hashes)
    cached = bm.block_table("a")
    bm.free("a")
    stats = (bm.prefix_cache_queries, bm.prefix_cache_hits)
    assert bm.lookup_range(hashes[:3], 1) == cached[1:3]
    assert bm.lookup_range(hashes[:3] + [hashes[0][::-1]], 2) is None
    assert bm.lookup_range(hashes[:2], 2) == []
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == stats  # counts nothing
    before = copy.deepcopy(bm.__dict__)
    assert not bm.can_allocate("b", 100, cached[1:3], skip=1)
    assert not bm.allocate("b", 100, cached[1:3], skip=1)
    assert bm.__dict__ == before  # atomic
    assert bm.allocate("b", 18, cached[1:3], skip=1)
    table = bm.block_table("b")
    assert table[:3] == [PLACEHOLDER, *cached[1:3]] and len(table) == 5
    with pytest.raises(ValueError, match="already has blocks"):
        bm.allocate("b", 20, [cached[0]])
    bm.cache_blocks("b", hashes, start=3)  # registers from position 3 on
    bm.check_integrity()
    broken = copy.deepcopy(bm)
    broken._tables["b"][3] = PLACEHOLDER  # a hole after a block
    broken.blocks[table[3]].ref_count = 0
    broken._free[table[3]] = None
    with pytest.raises(AssertionError, match="late hole"):
        broken.check_integrity()


def pools(main: int = 32, window: int = 32, caching: bool = True) -> KVBlocks:
    managers = [BlockManager(main, BS, caching), BlockManager(window, BS, caching)]
    return KVBlocks(managers, [None, WINDOW])


def test_prefix_hit_needs_the_window_blocks_before_it() -> None:
    """A hit of k blocks needs the window pool's blocks of positions [k*BS - WINDOW, k*BS);
    when one of them was evicted, the longest shorter hit that has them is taken."""
    kv = pools(window=6)
    hashes = compute_block_hashes(list(range(24)), BS)
    assert kv.allocate("a", 24)
    kv.cache_blocks("a", hashes)
    window_table = kv.block_tables("a")[1]
    kv.release("a", 24)  # the window pool keeps blocks 4 and 5 (positions >= 19)
    assert kv.block_tables("a")[1] == [PLACEHOLDER] * 4 + window_table[4:]
    kv.free("a")
    hit = kv.lookup(hashes[:5])
    assert hit.num_blocks == 5 and hit.blocks[1] == window_table[3:5]
    hit = kv.lookup(hashes[:3])  # positions [7, 12): window blocks 1 and 2
    assert hit.num_blocks == 3 and hit.blocks[1] == window_table[1:3]
    assert kv.allocate("x", 13, hit)  # its fresh window block evicts the LRU one: block 3
    assert kv.block_tables("x")[1] == [PLACEHOLDER, *window_table[1:4]]
    hits_before = kv.prefix_cache_hits
    hit = kv.lookup(hashes[:5])  # 5 and 4 lack block 3; 3 has blocks 1 and 2 (held by x)
    assert hit.num_blocks == 3 and hit.blocks[1] == window_table[1:3]
    assert kv.prefix_cache_hits == hits_before + 3  # the main pool found 5: 3 served
    kv.check_integrity()


def test_allocation_is_all_or_nothing_across_pools() -> None:
    kv = pools(main=16, window=3)
    before = copy.deepcopy([p.__dict__ for p in kv.pools])
    assert not kv.allocate("a", 16)  # the main pool fits 4 blocks, the window pool not
    assert [p.__dict__ for p in kv.pools] == before
    assert kv.allocate("a", 12)
    kv.release("a", 12)  # positions >= 7: blocks 1 and 2 stay
    assert kv.allocate("a", 16)  # a fourth position: the window pool has a free block again
    assert kv.slots("a", 16)[1] == [
        kv.block_tables("a")[1][p // BS] * BS + p % BS for p in range(11, 16)
    ]
    kv.check_integrity()


class WindowToyRunner:
    """ToyRunner (tests/test_scheduler) with a window pool: chunk tokens go into both pools;
    the sample is a function of the main pool's context, and the window pool must hold the
    same tokens for the positions the step reads there ([start - WINDOW, end))."""

    def __init__(self, main_blocks: int, window_blocks: int) -> None:
        self.main: list[list[int | None]] = [[None] * BS for _ in range(main_blocks)]
        self.window: list[list[int | None]] = [[None] * BS for _ in range(window_blocks)]

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        sampled = {}
        for c in out.chunks:
            (wt,) = c.window_tables
            end = c.start + len(c.token_ids)
            for pos, token in enumerate(c.token_ids, start=c.start):
                self.main[c.block_table[pos // BS]][pos % BS] = token
                self.window[wt[pos // BS]][pos % BS] = token
            context = [self.main[c.block_table[p // BS]][p % BS] for p in range(end)]
            for p in range(max(0, c.start - WINDOW), end):
                assert wt[p // BS] != PLACEHOLDER, (c.req_id, p)
                assert self.window[wt[p // BS]][p % BS] == context[p], (c.req_id, p)
            if c.sample:
                token = zlib.crc32(repr(context).encode()) % 16
                while token in c.banned_token_ids:
                    token += 1
                sampled[c.req_id] = token
        return RunnerOutput(sampled=sampled)


def run_workload(
    main: int = 64,
    window: int = 64,
    caching: bool = True,
    max_num_seqs: int = 8,
    budget: int = 64,
) -> tuple[dict[str, list[int]], Scheduler, int]:
    """Requests sharing prefixes, run to completion: their tokens, the scheduler, and the most
    window blocks held at once."""
    config = SchedulerConfig(max_num_seqs, budget, 128, caching)
    sched = Scheduler(config, pools(main, window, caching))
    runner = WindowToyRunner(main, window)
    shared = prompt(23)
    reqs = [
        request(f"r{i}", shared[: 5 + 3 * i] + prompt(i, first=50 + i), max_tokens=20 + i % 7)
        for i in range(7)
    ]
    for req in reqs:
        sched.add(req)
    most = 0
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        sched.blocks.check_integrity()
        most = max(most, window - sched.blocks.pools[1].num_free_blocks)
    assert not sched.has_unfinished()
    assert all(p.num_free_blocks == p.num_blocks for p in sched.blocks.pools)
    return {r.req_id: r.output_token_ids for r in reqs}, sched, most


@pytest.mark.parametrize(
    "config",
    [
        {"caching": True},
        {"budget": 5},
        {"window": 6, "budget": 5},  # the window pool is short: preemption, no deadlock
        {"main": 14, "budget": 7},
        {"max_num_seqs": 1, "budget": 3},
    ],
)
def test_outputs_do_not_depend_on_window_pools(config: dict[str, Any]) -> None:
    reference, _, _ = run_workload(main=128, caching=False, max_num_seqs=1)
    got, sched, most = run_workload(**config)
    assert got == reference
    # between steps a sequence holds ceil(WINDOW / BS) + 1 window blocks; a step adds its chunk
    seqs = min(config.get("max_num_seqs", 8), 7)
    assert most <= seqs * 3 + config.get("budget", 64) // BS + seqs
    if config.get("caching"):
        assert sched.blocks.prefix_cache_hits > 0
    if "window" in config:
        assert sched.num_preemptions > 0


def test_scheduler_takes_a_block_manager_as_one_pool() -> None:
    config = SchedulerConfig(2, 16, 64, True)
    sched = Scheduler(config, BlockManager(8, BS))
    assert sched.blocks.windows == [None]
    sched.add(request("a", prompt(6), max_tokens=2))
    step(sched)
    assert sched.blocks.block_tables("a") == [sched.blocks.block_table("a")]


def test_a_handoff_holds_and_caches_only_whole_window_blocks() -> None:
    """A request loaded from a handoff of 14 prompt tokens holds window rows only from
    position 14 - WINDOW = 9 on: its window blocks before 9 // BS are placeholders, and only
    blocks wholly loaded (from ceil(9 / BS) on) are cached."""
    kv = pools()
    hashes = compute_block_hashes(list(range(16)), BS)
    assert kv.allocate("h", 15, num_computed=14)
    main, window = kv.block_tables("h")
    assert len(main) == len(window) == 4 and window[:2] == [PLACEHOLDER] * 2
    assert [len(s) for s in kv.slots("h", 14)] == [14, WINDOW]
    kv.release("h", 16)  # 16 computed: positions >= 11 stay
    kv.cache_blocks("h", hashes[:4])
    assert kv.pools[1].lookup_range(hashes[:4], 2) is None  # block 2 lacks position 8's rows
    assert kv.pools[1].lookup_range(hashes[:4], 3) == [window[3]]
    kv.free("h")
    kv.check_integrity()
    assert kv.lookup(hashes[:4]).num_blocks == 0  # 4 blocks need window blocks 2 and 3
