"""Continuous batching with a token budget, chunked prefill, prefix caching and preemption.

A step is `schedule() -> SchedulerOutput`, `runner.execute(out) -> RunnerOutput`,
`scheduler.update(out, result)` (engine/steps.py). Running requests are served first, in
admission order; when blocks run out the most recently admitted running request is preempted
(its blocks freed, its progress recomputed later). Waiting requests are admitted while budget,
blocks and seats last. Blocks are those of every pool of the cache (thermostat.engine.kv_blocks):
a request short in any pool is treated alike; after each step a request's window pools release
the blocks that no later step reads.
"""

from __future__ import annotations

from collections import deque

from thermostat.engine.block_manager import BlockManager
from thermostat.engine.config import SchedulerConfig
from thermostat.engine.kv_blocks import KVBlocks, PrefixHit
from thermostat.engine.request import Request, RequestStatus
from thermostat.engine.speculative import (
    SpeculativeConfig,
    eligible,
    keeps_proposing,
    propose,
)
from thermostat.engine.steps import (
    NewRequestData,
    RunnerOutput,
    ScheduledChunk,
    ScheduledHandoff,
    SchedulerOutput,
)
from thermostat.errors import InvalidRequest
from thermostat.sampling.structured import ConstraintError


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: KVBlocks | BlockManager) -> None:
        self.config = config
        self.blocks = blocks if isinstance(blocks, KVBlocks) else KVBlocks([blocks], [None])
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._known_to_runner: set[str] = set()
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        # speculation needs a cache whose rows past the computed tokens nothing else reads: not
        # one with window pools (engine/speculative.py)
        spec = config.speculation
        self.speculation = spec if spec.on and len(self.blocks.pools) == 1 else SpeculativeConfig()

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        """Queue a request. Raises InvalidRequest if it could never fit in the KV cache alone,
        ValueError for a duplicate id (a caller's bug)."""
        longest = min(req.num_prompt_tokens + req.max_tokens, self.config.max_model_len)
        if self.blocks.num_blocks_needed(longest) > self.blocks.num_blocks:
            raise InvalidRequest(
                "max_tokens",
                f"request needs {longest} tokens of KV cache, more than the whole cache "
                f"({self.blocks.num_blocks * self.block_size} tokens)",
            )
        if req.req_id in self.requests:
            raise ValueError(f"duplicate request id {req.req_id!r}")
        constraint = req.constraint
        if constraint is not None and not constraint.allows_any(req.banned_token_ids()):
            param = constraint.spec.param
            raise ConstraintError(param, f"{param}: the constraint allows no first token")
        req.update_block_hashes(self.block_size)
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def abort(self, req_id: str) -> Request | None:
        req = self.requests.get(req_id)
        if req is not None and not req.finished:
            self.finish(req, "abort")
        return req

    def finish(self, req: Request, reason: str, stop_reason: str | int | None = None) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status, req.finish_reason, req.stop_reason = RequestStatus.FINISHED, reason, stop_reason
        self.blocks.free(req.req_id)
        del self.requests[req.req_id]
        if req.req_id in self._known_to_runner:
            self._known_to_runner.discard(req.req_id)
            self._finished_ids.append(req.req_id)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_behind, budget)
            proposed = self._proposal(req, budget) if req.num_behind == 1 else []
            if proposed and req.constraint is not None:  # as far as the grammar allows them
                proposed, masks = req.constraint.lookahead(proposed)
            if proposed and self.blocks.allocate(
                req.req_id, req.num_computed_tokens + 1 + len(proposed)
            ):  # room for the proposals too (no request is preempted for them)
                chunk = self._chunk(req, 1)
                chunk.token_ids.extend(proposed)
                chunk.proposed = proposed
                if req.constraint is not None:
                    chunk.proposed_allowed = masks
                out.chunks.append(chunk)
                budget -= len(chunk.token_ids)
                i += 1
                continue
            if not self._reserve(req, n):
                preempted = True
                break
            out.chunks.append(self._chunk(req, n))
            budget -= n
            i += 1
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            hit = None if req.from_handoff is not None else self._prefix_hit(req)
            cached = 0 if hit is None else hit.num_blocks * self.block_size
            computed = req.num_prompt_tokens if req.from_handoff is not None else cached
            n = min(req.num_tokens - computed, budget)
            if not self.blocks.allocate(req.req_id, computed + n, hit, computed):
                break
            self.waiting.popleft()
            if req.from_handoff is not None:
                slots = self.slots(req.req_id, computed)
                out.handoffs.append(ScheduledHandoff(req.req_id, slots, req.from_handoff))
                req.from_handoff = None
            if req.num_preemptions == 0:
                req.num_cached_tokens = cached
            req.num_computed_tokens = computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.req_id not in self._known_to_runner:
                self._known_to_runner.add(req.req_id)
                out.new_requests.append(
                    NewRequestData(req.req_id, req.prompt_token_ids, req.params)
                )
            out.chunks.append(self._chunk(req, n))
            budget -= n
        return out

    def _proposal(self, req: Request, budget: int) -> list[int]:
        """The tokens a decoding request proposes to check this step (none if it does not
        speculate, or has no room: its budget, max_tokens and the context each take the model's
        own next token too)."""
        spec = self.speculation
        if (
            not spec.on
            or len(self.running) > spec.max_running
            or req.handoff
            or not eligible(req.params, req.num_output_tokens)
            or not keeps_proposing(req.num_proposed, req.num_accepted)
        ):
            return []
        room = min(
            spec.k,
            budget - 1,
            req.max_tokens - req.num_output_tokens - 1,
            self.config.max_model_len - req.num_tokens - 1,
        )
        if room <= 0:
            return []
        if spec.method == "mtp":
            return req.drafts[:room]
        return propose(req.prompt_token_ids + req.output_token_ids, spec.ngram, room)

    def _reserve(self, req: Request, n: int) -> bool:
        """Blocks for n more tokens of `req`, preempting from the tail of `running` as needed.
        False if `req` itself had to be preempted."""
        while not self.blocks.allocate(req.req_id, req.num_computed_tokens + n):
            victim = self.running.pop()
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.blocks.free(req.req_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def slots(self, req_id: str, num_tokens: int) -> list[list[int]]:
        """Per pool, the cache slots of a request's positions [0, num_tokens) that later steps
        read (a window pool's: the last `window`; KVBlocks.slots)."""
        return self.blocks.slots(req_id, num_tokens)

    def _prefix_hit(self, req: Request) -> PrefixHit | None:
        """Cached blocks for the request's leading full blocks. At least one token is always
        left to compute (its logits are needed), and prompt logprobs need every position."""
        if not self.config.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return None
        usable = (req.num_tokens - 1) // self.block_size
        return self.blocks.lookup(req.block_hashes[:usable])

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        catches_up = start + n == req.num_tokens
        sample = catches_up and req.num_output_tokens < req.max_tokens
        constraint = req.constraint if sample else None
        main, *windows = self.blocks.block_tables(req.req_id)
        return ScheduledChunk(
            req_id=req.req_id,
            token_ids=req.token_ids(start, start + n),
            start=start,
            block_table=main,
            window_tables=windows,
            sample=sample,
            banned_token_ids=req.banned_token_ids(),
            allowed_tokens=None if constraint is None else constraint.mask(),
        )

    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Advance counters by what the runner computed; append sampled tokens; finish requests
        that hit a stop condition (the one place a generation ends, except abort). Returns the
        requests that progressed."""
        progressed = []
        for chunk in out.chunks:
            req = self.requests.get(chunk.req_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted meanwhile
            more = result.speculated.get(req.req_id, [])  # proposals confirmed, then the next
            req.drafts = result.drafts.get(req.req_id, [])
            if chunk.proposed:  # the rows of the last token and the confirmed proposals hold
                req.num_computed_tokens += 1 + len(more)
                req.num_proposed += len(chunk.proposed)
                req.num_accepted += len(more)
                req.num_verifications += 1
            else:
                req.num_computed_tokens += len(chunk.token_ids)
            ending: tuple[str, str | int | None] | None = None
            token = result.sampled.get(req.req_id)
            if token is not None:
                req.output_token_ids.append(token)
                if req.handoff:  # its blocks are read before the next step (LLMEngine.step)
                    req.handoff_slots = self.slots(req.req_id, req.num_prompt_tokens)
                    ending = ("handoff", None)
                else:
                    ending = self._ending(req, token)
                for extra in more:  # each as if it came in a step of its own
                    if ending is not None:
                        break
                    req.output_token_ids.append(extra)
                    ending = self._ending(req, extra)
            elif not chunk.sample and req.num_behind == 0:
                ending = ("length", None)  # max_tokens == 0: prompt only (echo with logprobs)
            if self.config.enable_prefix_caching:
                req.update_block_hashes(self.block_size)
                full = req.num_computed_tokens // self.block_size
                self.blocks.cache_blocks(req.req_id, req.block_hashes[:full])
            progressed.append(req)
            if ending is not None:
                self.finish(req, *ending)
            else:
                self.blocks.release(req.req_id, req.num_computed_tokens)
        return progressed

    def _ending(self, req: Request, token: int) -> tuple[str, str | int | None] | None:
        """(finish_reason, stop_reason) if `token` ends the request. A stop token first (it is
        never sampled before min_tokens: banned until then), then the text's stop conditions
        (stop strings, a loop), then a constraint that is complete ("stop") or refused the
        token, then length, then a constraint that allows no next token: ("error",
        "constraint_dead_end"), e.g. a complete grammar whose EOS min_tokens still bans."""
        if token in req.stop_ids:
            return "stop", token
        if req.text is not None and (stop := req.text.add(token)) is not None:
            return "stop", stop
        constraint = req.constraint
        if constraint is not None:
            if not constraint.advance(token):
                return "error", "constraint_dead_end"
            if constraint.complete:
                return "stop", None
        if req.num_output_tokens >= req.max_tokens:
            return "length", None
        if req.num_tokens >= self.config.max_model_len:
            return "length", None
        detection = req.params.repetition_detection
        if detection is not None and detection.ends(req.output_token_ids, req.params.min_tokens):
            return "repetition", "repetition_detected"
        if constraint is not None and not constraint.allows_any(req.banned_token_ids()):
            return "error", "constraint_dead_end"
        return None
