"""Tests for the scheduler, driven directly with a real BlockManager and no model.

`step()` plays the runner: it answers each sampling chunk with a chosen token. `ToyRunner` plays
it more faithfully, writing chunk tokens into KV slots through the block table and sampling a
function of what the slots hold, so a wrong block table, a stale prefix hit or a bad recompute
changes the output.
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest

from thermostat.engine.block_manager import BlockManager
from thermostat.engine.config import SchedulerConfig
from thermostat.engine.request import Request, RequestStatus
from thermostat.engine.scheduler import Scheduler
from thermostat.engine.steps import RunnerOutput, SchedulerOutput
from thermostat.errors import InvalidRequest
from thermostat.sampling.fields import BUILTIN
from thermostat.sampling.params import EffectiveParams

BS = 4  # block size
EOS = 0
FILLER = 7  # the token the fake runner samples when a test does not name one


def params(max_tokens: int = 8, **fields: Any) -> EffectiveParams:
    """Greedy and neutral; the scheduler reads only max_tokens, min_tokens, prompt_logprobs."""
    return EffectiveParams(**(BUILTIN | {"temperature": 0.0}), max_tokens=max_tokens, **fields)


def prompt(n: int, first: int = 100) -> list[int]:
    return list(range(first, first + n))


def request(
    req_id: str,
    prompt_ids: list[int],
    max_tokens: int = 8,
    stop_ids: frozenset[int] = frozenset({EOS}),
    **fields: Any,
) -> Request:
    return Request(req_id, prompt_ids, params(max_tokens, **fields), stop_ids)


def scheduler(
    num_blocks: int = 32,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 128,
    caching: bool = True,
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, caching)
    return Scheduler(config, BlockManager(num_blocks, BS, enable_prefix_caching=caching))


def step(sched: Scheduler, sampled: dict[str, int] | None = None) -> SchedulerOutput:
    """One engine step with a fake runner: each chunk with `sample` set gets `sampled[req_id]`
    (FILLER when absent); naming a request that does not sample this step is a test error.
    The only place that drives schedule/update, so an API change is adapted here."""
    sampled = sampled or {}
    out = sched.schedule()
    sampling = {c.req_id for c in out.chunks if c.sample}
    assert set(sampled) <= sampling, f"not sampling this step: {set(sampled) - sampling}"
    sched.update(out, RunnerOutput(sampled={r: sampled.get(r, FILLER) for r in sampling}))
    sched.blocks.check_integrity()
    return out


def chunks(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(req_id, start, length, sample) of each chunk, in order."""
    return [(c.req_id, c.start, len(c.token_ids), c.sample) for c in out.chunks]


# --- admission and the token budget ---------------------------------------------------------------


def test_admits_in_arrival_order_up_to_max_num_seqs() -> None:
    sched = scheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add(request(rid, prompt(3)))
    out = step(sched, {"a": EOS})
    assert chunks(out) == [("a", 0, 3, True), ("b", 0, 3, True)]
    assert [n.req_id for n in out.new_requests] == ["a", "b"]
    assert [r.req_id for r in sched.waiting] == ["c"]
    out = step(sched)  # a finished: its seat goes to c
    assert chunks(out) == [("b", 3, 1, True), ("c", 0, 3, True)]
    assert [n.req_id for n in out.new_requests] == ["c"]


def test_long_prompt_is_prefilled_in_budget_sized_chunks() -> None:
    sched = scheduler(max_num_batched_tokens=8)
    req = request("a", prompt(20))
    sched.add(req)
    steps = [step(sched) for _ in range(4)]
    assert [chunks(out) for out in steps] == [
        [("a", 0, 8, False)],
        [("a", 8, 8, False)],
        [("a", 16, 4, True)],  # catches up: samples
        [("a", 20, 1, True)],  # decode: the sampled token
    ]
    assert [c.token_ids for out in steps[:3] for c in out.chunks] == [
        req.prompt_token_ids[0:8],
        req.prompt_token_ids[8:16],
        req.prompt_token_ids[16:20],
    ]
    assert steps[3].chunks[0].token_ids == [FILLER]
    assert [len(out.new_requests) for out in steps] == [1, 0, 0, 0]
    assert (req.num_computed_tokens, req.output_token_ids) == (21, [FILLER, FILLER])


def test_running_requests_are_served_before_waiting_ones() -> None:
    sched = scheduler(max_num_batched_tokens=8)
    sched.add(request("a", prompt(20)))
    step(sched)
    sched.add(request("b", prompt(6, first=200)))
    assert chunks(step(sched)) == [("a", 8, 8, False)]  # a's chunk uses the whole budget
    assert chunks(step(sched)) == [("a", 16, 4, True), ("b", 0, 4, False)]
    assert chunks(step(sched)) == [("a", 20, 1, True), ("b", 4, 2, True)]


# --- prefix caching -------------------------------------------------------------------------------


def test_prefix_cache_hit_skips_the_shared_full_blocks() -> None:
    sched = scheduler()
    sched.add(request("a", prompt(10)))  # 2 full blocks + 2 tokens
    step(sched)
    b = request("b", [*prompt(8), 1, 2, 3])  # shares a's 2 full blocks
    sched.add(b)
    out = step(sched)
    assert chunks(out)[1] == ("b", 8, 3, True)
    assert (b.num_cached_tokens, b.num_computed_tokens) == (8, 11)
    assert sched.blocks.block_table("b")[:2] == sched.blocks.block_table("a")[:2]


def test_prefix_cache_hit_still_computes_the_last_prompt_token() -> None:
    sched = scheduler()
    sched.add(request("a", prompt(8), max_tokens=1))  # exactly 2 full blocks
    step(sched)
    assert sched.requests == {}  # finished; its blocks stay cached
    b = request("b", prompt(8))
    sched.add(b)
    # Both blocks are cached, but the last token's logits are needed: only block 0 is reused.
    assert chunks(step(sched)) == [("b", 4, 4, True)]
    assert b.num_cached_tokens == 4


def test_no_prefix_cache_hit_when_prompt_logprobs_are_asked() -> None:
    sched = scheduler()
    sched.add(request("a", prompt(10)))
    step(sched)
    b = request("b", prompt(10), prompt_logprobs=1)
    sched.add(b)
    assert chunks(step(sched))[1] == ("b", 0, 10, True)
    assert b.num_cached_tokens == 0


def test_no_prefix_cache_hit_when_caching_is_off() -> None:
    sched = scheduler(caching=False)
    sched.add(request("a", prompt(10)))
    step(sched)
    b = request("b", prompt(10))
    sched.add(b)
    assert chunks(step(sched))[1] == ("b", 0, 10, True)
    assert b.num_cached_tokens == 0


# --- preemption -----------------------------------------------------------------------------------


def test_preemption_frees_the_newest_request_which_comes_back_first() -> None:
    sched = scheduler(num_blocks=4, max_num_seqs=2, caching=False)  # 16 token slots
    a = request("a", prompt(6), max_tokens=4)
    b = request("b", prompt(6, first=200), max_tokens=4)
    for req in (a, b, request("c", prompt(3, first=300))):
        sched.add(req)
    for token in (21, 22, 23):  # each request grows to 9 tokens: 2 blocks each, cache full
        step(sched, {"a": token + 10, "b": token})
    out = step(sched, {"a": 34})  # a needs a 3rd block: b, admitted last, is preempted
    assert chunks(out) == [("a", 8, 1, True)]
    assert b.status is RequestStatus.WAITING and sched.waiting[0] is b
    assert (b.num_computed_tokens, b.num_preemptions, sched.num_preemptions) == (0, 1, 1)
    assert sched.blocks.block_table("b") == []
    assert a.finish_reason == "length"  # 4 tokens
    assert [r.req_id for r in sched.waiting] == ["b", "c"]
    out = step(sched, {"b": 24})  # b goes before c and recomputes prompt + its outputs
    assert chunks(out) == [("b", 0, 9, True), ("c", 0, 3, True)]
    assert out.chunks[0].token_ids == b.prompt_token_ids + [21, 22, 23]
    assert [n.req_id for n in out.new_requests] == ["c"]  # the runner still knows b
    assert b.output_token_ids == [21, 22, 23, 24] and b.finish_reason == "length"
    assert a.output_token_ids == [31, 32, 33, 34]


# --- finishing ------------------------------------------------------------------------------------


def test_stop_token_finishes_with_stop_and_frees_blocks() -> None:
    sched = scheduler()
    req = request("a", prompt(5), stop_ids=frozenset({EOS, 9}))
    sched.add(req)
    step(sched)
    step(sched, {"a": 9})
    assert (req.finish_reason, req.output_token_ids) == ("stop", [FILLER, 9])
    assert req.finished and not sched.has_unfinished()
    assert sched.blocks.block_table("a") == [] and sched.blocks.usage == 0.0


class StopAt:
    """Text-level stops (a stop string, a loop) as the scheduler sees them: a token that ends
    the text returns a stop reason. Records what it was fed."""

    def __init__(self, token: int, reason: str) -> None:
        self.token, self.reason = token, reason
        self.fed: list[int] = []

    def add(self, token_id: int) -> str | None:
        self.fed.append(token_id)
        return self.reason if token_id == self.token else None


def test_a_text_stop_finishes_in_the_same_update_as_a_stop_token() -> None:
    sched = scheduler()
    req = request("a", prompt(5))
    req.text = StopAt(11, "</end>")
    sched.add(req)
    step(sched)
    step(sched, {"a": 11})
    assert (req.finish_reason, req.stop_reason) == ("stop", "</end>")
    assert req.finished and not sched.has_unfinished() and sched.blocks.usage == 0.0
    assert req.text.fed == [FILLER, 11]


def test_a_stop_token_wins_and_is_never_fed_to_the_text() -> None:
    sched = scheduler()
    req = request("a", prompt(5))
    req.text = StopAt(EOS, "never")
    sched.add(req)
    step(sched, {"a": EOS})
    assert (req.finish_reason, req.stop_reason) == ("stop", EOS)
    assert req.text.fed == []


def test_a_text_stop_on_the_last_allowed_token_is_a_stop_not_length() -> None:
    sched = scheduler()
    req = request("a", prompt(5), max_tokens=2)
    req.text = StopAt(11, "loop")
    sched.add(req)
    step(sched)
    step(sched, {"a": 11})
    assert (req.finish_reason, req.stop_reason, req.num_output_tokens) == ("stop", "loop", 2)


def test_max_tokens_finishes_with_length() -> None:
    sched = scheduler()
    req = request("a", prompt(5), max_tokens=2)
    sched.add(req)
    step(sched)
    assert not req.finished
    step(sched)
    assert (req.finish_reason, req.num_output_tokens) == ("length", 2)


def test_context_length_finishes_with_length() -> None:
    sched = scheduler(max_model_len=8)
    req = request("a", prompt(6), max_tokens=100)
    sched.add(req)  # fits: the context length caps it at 8 tokens
    step(sched)
    step(sched)
    assert (req.finish_reason, req.num_tokens) == ("length", 8)


def test_max_tokens_zero_finishes_after_the_prompt_without_sampling() -> None:
    sched = scheduler(max_num_batched_tokens=4)
    req = request("a", prompt(6), max_tokens=0)
    sched.add(req)
    assert chunks(step(sched)) == [("a", 0, 4, False)]
    assert not req.finished
    assert chunks(step(sched)) == [("a", 4, 2, False)]
    assert (req.finish_reason, req.output_token_ids) == ("length", [])


def test_min_tokens_bans_stop_ids_until_reached() -> None:
    sched = scheduler()
    sched.add(request("a", prompt(3), min_tokens=2, stop_ids=frozenset({9, EOS})))
    banned = [step(sched).chunks[0].banned_token_ids for _ in range(3)]
    assert banned == [(EOS, 9), (EOS, 9), ()]


# --- abort and the runner's view ------------------------------------------------------------------


def test_abort_waiting_request_is_never_reported_to_the_runner() -> None:
    sched = scheduler(max_num_seqs=1)
    sched.add(request("a", prompt(3)))
    sched.add(request("b", prompt(3)))
    step(sched)
    aborted = sched.abort("b")
    assert aborted is not None and aborted.finish_reason == "abort"
    assert [r.req_id for r in sched.waiting] == []
    assert step(sched).finished_ids == []
    assert sched.abort("b") is None  # already gone


def test_abort_running_request_frees_blocks_and_is_reported_once() -> None:
    sched = scheduler()
    sched.add(request("a", prompt(6)))
    step(sched)
    sched.abort("a")
    assert sched.blocks.usage == 0.0 and not sched.has_unfinished()
    assert step(sched).finished_ids == ["a"]
    assert step(sched).finished_ids == []


def test_finished_request_is_reported_to_the_runner_once() -> None:
    sched = scheduler()
    sched.add(request("a", prompt(3)))
    step(sched, {"a": EOS})
    assert step(sched).finished_ids == ["a"]
    assert step(sched).finished_ids == []


def test_abort_during_a_step_drops_its_result() -> None:
    sched = scheduler()
    req = request("a", prompt(3))
    sched.add(req)
    out = sched.schedule()
    sched.abort("a")
    assert sched.update(out, RunnerOutput(sampled={"a": FILLER})) == []
    assert req.output_token_ids == [] and req.finish_reason == "abort"
    sched.blocks.check_integrity()


# --- add ------------------------------------------------------------------------------------------


def test_add_refuses_a_duplicate_id() -> None:
    sched = scheduler()
    first = request("a", prompt(3))
    sched.add(first)
    with pytest.raises(ValueError, match="duplicate"):
        sched.add(request("a", prompt(4)))
    assert sched.requests == {"a": first} and list(sched.waiting) == [first]


def test_add_refuses_a_request_larger_than_the_whole_cache() -> None:
    sched = scheduler(num_blocks=4)  # 16 token slots
    with pytest.raises(InvalidRequest, match="whole cache"):
        sched.add(request("a", prompt(10), max_tokens=7))
    assert not sched.has_unfinished()
    sched.add(request("b", prompt(10), max_tokens=6))  # exactly 16 tokens
    small = scheduler(num_blocks=4, max_model_len=16)
    small.add(request("c", prompt(10), max_tokens=100))  # capped by the context length


# --- a toy model: outputs do not depend on how the work was scheduled ----------------------------


class ToyRunner:
    """The runner's contract without a model. Chunk tokens are written into KV slots through the
    block table; a sampled token is a function of every token the slots hold for positions
    [0, end). Checks that the runner hears of each request before its first chunk and that
    `finished_ids` names only requests it knows, once."""

    def __init__(self, num_blocks: int) -> None:
        self.slots: list[list[int | None]] = [[None] * BS for _ in range(num_blocks)]
        self.known: set[str] = set()

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        for rid in out.finished_ids:
            self.known.remove(rid)  # KeyError: unknown or reported twice
        for new in out.new_requests:
            assert new.req_id not in self.known
            self.known.add(new.req_id)
        sampled = {}
        for c in out.chunks:
            assert c.req_id in self.known
            for pos, token in enumerate(c.token_ids, start=c.start):
                self.slots[c.block_table[pos // BS]][pos % BS] = token
            end = c.start + len(c.token_ids)
            context = [self.slots[c.block_table[p // BS]][p % BS] for p in range(end)]
            assert None not in context
            if c.sample:
                token = zlib.crc32(repr(context).encode()) % 16  # 0 is EOS: some stop early
                while token in c.banned_token_ids:
                    token += 1
                sampled[c.req_id] = token
        return RunnerOutput(sampled=sampled)


def run_workload(**config: Any) -> tuple[dict[str, list[int]], Scheduler]:
    """Requests sharing prefixes, run to completion; their output tokens."""
    sched = scheduler(**config)
    runner = ToyRunner(sched.blocks.num_blocks)
    shared = prompt(9)
    reqs = [
        request(f"r{i}", shared[: 3 + 2 * i] + prompt(i, first=50 + i), max_tokens=4 + i % 5)
        for i in range(8)
    ]
    reqs.append(request("min", shared, max_tokens=6, min_tokens=6))
    for req in reqs:
        sched.add(req)
    for _ in range(500):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        sched.blocks.check_integrity()
    runner.execute(sched.schedule())  # the last finished_ids
    assert not sched.has_unfinished() and runner.known == set()
    return {r.req_id: r.output_token_ids for r in reqs}, sched


def test_outputs_do_not_depend_on_chunking_caching_or_preemption() -> None:
    reference, _ = run_workload(num_blocks=64, max_num_batched_tokens=256, caching=False)
    assert any(tokens[-1] == EOS for tokens in reference.values())
    assert len(reference["min"]) == 6
    chunked, _ = run_workload(max_num_batched_tokens=5, caching=False)
    cached, sched = run_workload(num_blocks=64, max_num_seqs=2)
    assert sched.blocks.prefix_cache_hits > 0
    tight, sched = run_workload(num_blocks=6, max_num_batched_tokens=7)
    assert sched.num_preemptions > 0
    assert chunked == reference and cached == reference and tight == reference
