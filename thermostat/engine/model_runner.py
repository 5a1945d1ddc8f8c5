"""Runs one scheduled step: builds the flat batch and attention metadata, runs the model,
samples. Keeps per-request sampling state (seeded generator, tokens seen) between steps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from thermostat.engine.constraint import Bitmask
from thermostat.engine.logprobs import prompt_logprobs
from thermostat.engine.repetition import BreakerTokens
from thermostat.engine.sampler import (
    SamplingBatch,
    argmax_rows,
    draw_uniforms,
    sample_batch,
)
from thermostat.engine.speculative import accepted, draft_inputs
from thermostat.engine.steps import (
    NewRequestData,
    RunnerOutput,
    ScheduledChunk,
    ScheduledHandoff,
    SchedulerOutput,
)
from thermostat.models.attention import AttentionMetadata, PrefillSegment
from thermostat.models.kv_cache import PagedKVCache
from thermostat.models.registry import CausalLM, Drafter


@dataclass
class RunnerRequest:
    data: NewRequestData
    generator: torch.Generator | None
    dry_breakers: frozenset[int] = frozenset()  # DRY's sequence breakers' token ids
    output_token_ids: list[int] = field(default_factory=list)


@dataclass(eq=False)
class ModelRunner:
    model: CausalLM
    cache: PagedKVCache
    block_size: int
    sliding_window: int | None = None
    drafter: Drafter | None = None  # `--speculative mtp`: the model, whose next-n layer proposes
    breakers: BreakerTokens | None = None  # DRY's breaker strings -> token ids (the tokenizer's)
    requests: dict[str, RunnerRequest] = field(default_factory=dict, init=False)

    def execute(
        self, out: SchedulerOutput, before_forward: Callable[[], None] | None = None
    ) -> RunnerOutput:
        """Run the step; `before_forward` is called once the inputs are ready, right before the
        model's forward leaves Python (a caller's moment to hand out what it holds)."""
        for req_id in out.finished_ids:
            self.requests.pop(req_id, None)
        for data in out.new_requests:
            seed = data.params.seed
            gen = None if seed is None else torch.Generator().manual_seed(seed)
            breakers: frozenset[int] = frozenset()
            if data.params.dry_multiplier > 0.0 and self.breakers is not None:
                breakers = self.breakers.ids(data.params.dry_sequence_breakers)
            self.requests[data.req_id] = RunnerRequest(data, gen, breakers)
        result = RunnerOutput()
        for scheduled in out.handoffs:
            self._load_handoff(scheduled, result)
        # Decode rows first, batched: a decode (one token) or a speculating request's tokens (one
        # row each); then prefill chunks. A request loaded from a handoff has a chunk of no
        # tokens: its first token came with its rows.
        chunks = sorted((c for c in out.chunks if c.token_ids), key=lambda c: not _decode_rows(c))
        if not chunks:
            return result
        input_ids, positions, meta = self._prepare(chunks)
        if before_forward is not None:
            before_forward()
        hidden = self.model(input_ids, positions, meta, self.cache)
        self._sample(chunks, hidden, result)
        if self.drafter is not None:
            self._draft(self.drafter, chunks, hidden, positions, meta, result)
        offset = 0
        for chunk in chunks:
            n, data = len(chunk.token_ids), self.requests[chunk.req_id].data
            if data.params.prompt_logprobs is not None:
                result.prompt_logprobs[chunk.req_id] = prompt_logprobs(
                    self.model.compute_logits, data.prompt_token_ids, chunk.start,
                    hidden[offset : offset + n], data.params.prompt_logprobs,
                )  # fmt: skip
            offset += n
        return result

    def _sample(
        self, chunks: list[ScheduledChunk], hidden: torch.Tensor, out: RunnerOutput
    ) -> None:
        """The next token of every chunk that catches up: scored at its last row, or at every row
        of a speculating chunk (its proposals are accepted while the model's tokens equal them;
        engine/speculative.py)."""
        rows: list[int] = []  # hidden rows to score
        scored: list[tuple[ScheduledChunk, int]] = []  # the chunk of each scored row, the row
        offset = 0
        for chunk in chunks:
            n = len(chunk.token_ids)
            if chunk.sample:
                width = n if chunk.proposed else 1
                rows.extend(range(offset + n - width, offset + n))
                scored.extend((chunk, i) for i in range(width))
            offset += n
        if not rows:
            return
        logits = self.model.compute_logits(hidden[torch.tensor(rows)])
        drawn = self._generator_states(scored)
        sampled = sample_batch(logits, self._sampling_batch(scored))
        at = 0
        for chunk in (c for c in chunks if c.sample):  # in the order of their scored rows
            width = 1 + len(chunk.proposed)
            tokens = sampled.token_ids[at : at + width]
            logprobs = sampled.logprobs[at : at + width]
            at += width
            keep = 1 + accepted(chunk.proposed, tokens)  # t0, then the confirmed proposals' next
            req = self.requests[chunk.req_id]
            req.output_token_ids.extend(tokens[:keep])
            if chunk.req_id in drawn and keep < width:  # as if the rejected rows had not drawn
                assert req.generator is not None
                req.generator.set_state(drawn[chunk.req_id])
                for _ in range(keep):
                    draw_uniforms(logits.shape[-1], req.generator)
            out.sampled[chunk.req_id] = tokens[0]
            if logprobs[0] is not None:
                out.logprobs[chunk.req_id] = logprobs[0]
            if chunk.proposed:
                out.speculated[chunk.req_id] = tokens[1:keep]
                if logprobs[0] is not None:
                    out.speculated_logprobs[chunk.req_id] = [
                        lp for lp in logprobs[1:keep] if lp is not None
                    ]

    def _draft(
        self,
        drafter: Drafter,
        chunks: list[ScheduledChunk],
        hidden: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        out: RunnerOutput,
    ) -> None:
        """The next-n layer over every row of the step (its cache slots hold every computed
        position; speculative.draft_inputs); each request that sampled gets its draft."""
        emitted = {c.req_id: [out.sampled[c.req_id]] for c in chunks if c.sample}
        for req_id, more in out.speculated.items():
            emitted[req_id] += more
        next_ids, rows, drafting = draft_inputs(chunks, emitted, self._sequence)
        logits = drafter.draft(
            hidden,
            torch.tensor(next_ids, dtype=torch.int64),
            positions,
            meta,
            self.cache,
            torch.tensor(rows, dtype=torch.int64),
        )
        for req_id, token in zip(drafting, argmax_rows(logits).tolist(), strict=True):
            out.drafts[req_id] = [token]

    def _sequence(self, req_id: str) -> list[int]:
        req = self.requests[req_id]
        return req.data.prompt_token_ids + req.output_token_ids

    def _generator_states(
        self, scored: list[tuple[ScheduledChunk, int]]
    ) -> dict[str, torch.Tensor]:
        """The generator state of each seeded, sampled, speculating request before its draws."""
        states = {}
        for chunk, i in scored:
            req = self.requests[chunk.req_id]
            greedy = req.data.params.greedy
            if i == 0 and chunk.proposed and req.generator is not None and not greedy:
                states[chunk.req_id] = req.generator.get_state()
        return states

    def _load_handoff(self, scheduled: ScheduledHandoff, result: RunnerOutput) -> None:
        """Another engine's prefill: its rows into this cache, its first token as this step's
        sample, its generator where that token left it."""
        handoff = scheduled.handoff
        slots = [torch.tensor(s, dtype=torch.int64) for s in scheduled.slots]
        self.cache.load(slots, handoff.rows)
        req = self.requests[scheduled.req_id]
        if req.generator is not None and handoff.generator_state is not None:
            req.generator.set_state(handoff.generator_state)
        req.output_token_ids.append(handoff.first_token)
        result.sampled[scheduled.req_id] = handoff.first_token
        if handoff.first_logprobs is not None:
            result.logprobs[scheduled.req_id] = handoff.first_logprobs

    def generator_state(self, req_id: str) -> torch.Tensor | None:
        """A request's seeded generator state (None if unseeded), until its finish is seen."""
        req = self.requests.get(req_id)
        return None if req is None or req.generator is None else req.generator.get_state()

    def _sampling_batch(self, scored: list[tuple[ScheduledChunk, int]]) -> SamplingBatch:
        """One row per scored row: row i of a speculating chunk is sampled as if its proposals
        before it had been (they count as output; the grammar's mask after them)."""
        reqs = [self.requests[c.req_id] for c, _ in scored]
        params = [r.data.params for r in reqs]
        return SamplingBatch.of(
            params,
            generators=[r.generator for r in reqs],
            prompt_ids=[r.data.prompt_token_ids for r in reqs],
            output_ids=[
                r.output_token_ids + c.proposed[:i] if i else r.output_token_ids
                for r, (c, i) in zip(reqs, scored, strict=True)
            ],
            banned_ids=[list(c.banned_token_ids) for c, _ in scored],
            allowed=[_allowed(c, i) for c, i in scored],
            num_logprobs=[p.logprobs for p in params],
            dry_breakers=[r.dry_breakers for r in reqs],
            seeds=[p.seed for p in params],
        )

    def _prepare(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []  # each new token's cache slot, then per window pool
        window_slots: list[list[int]] = [[] for _ in chunks[0].window_tables]
        for c in chunks:
            span = range(c.start, c.start + len(c.token_ids))
            input_ids.extend(c.token_ids)
            positions.extend(span)
            slots.extend(c.block_table[p // bs] * bs + p % bs for p in span)
            for pool_slots, pool_table in zip(window_slots, c.window_tables, strict=True):
                pool_slots.extend(pool_table[p // bs] * bs + p % bs for p in span)
        decodes = [c for c in chunks if _decode_rows(c)]
        tables = self._block_tables([c.block_table for c in chunks])
        window_tables = tuple(
            self._block_tables([c.window_tables[p] for c in chunks])
            for p in range(len(chunks[0].window_tables))
        )

        # one decode row per token of a decode chunk, each attending up to its own position
        lens = [c.start + j + 1 for c in decodes for j in range(len(c.token_ids))]
        nd = len(lens)
        num_blocks = (max(lens) + bs - 1) // bs if nd else 0
        if nd == len(decodes):  # one row per decode chunk: the first nd tables
            decode_tables = tables[:nd, :num_blocks].contiguous()
        else:
            decode_owner = [i for i, c in enumerate(decodes) for _ in c.token_ids]
            decode_tables = tables[decode_owner, :num_blocks].contiguous()
        context_lens = torch.tensor(lens, dtype=torch.int64)
        ctx_pos = torch.arange(num_blocks * bs)
        decode_mask = ctx_pos[None, :] < context_lens[:, None]
        if self.sliding_window is not None:
            decode_mask &= ctx_pos[None, :] > context_lens[:, None] - 1 - self.sliding_window
        prefills = []
        for i, c in enumerate(chunks[len(decodes) :], start=len(decodes)):
            q_len, ctx_len = len(c.token_ids), c.start + len(c.token_ids)
            table = tables[i : i + 1, : (ctx_len + bs - 1) // bs]
            prefills.append(
                PrefillSegment(q_len, ctx_len, table, self._prefill_mask(c.start, q_len))
            )
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_decodes=nd,
            decode_block_tables=decode_tables,
            decode_context_lens=context_lens,
            decode_mask=decode_mask[:, None, None, :],
            prefills=prefills,
            sliding_window=self.sliding_window,
            window_slot_mappings=tuple(torch.tensor(w, dtype=torch.int64) for w in window_slots),
            window_block_tables=window_tables,
        )
        return (
            torch.tensor(input_ids, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            meta,
        )

    def _prefill_mask(self, start: int, q_len: int) -> torch.Tensor | None:
        """[q_len, start + q_len] bool, True = attend; None = plain causal from position 0."""
        window = self.sliding_window
        if start == 0 and (window is None or window >= q_len):
            return None
        q_pos = torch.arange(start, start + q_len)[:, None]
        kv_pos = torch.arange(start + q_len)[None, :]
        mask = kv_pos <= q_pos
        if window is not None:
            mask &= kv_pos > q_pos - window
        return mask

    @staticmethod
    def _block_tables(tables: list[list[int]]) -> torch.Tensor:
        width = max(len(t) for t in tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)


def _allowed(chunk: ScheduledChunk, row: int) -> Bitmask | None:
    """The bitmask of a chunk's scored row (row i > 0 of a speculating chunk: after i proposals)."""
    if row == 0 or not chunk.proposed_allowed:
        return chunk.allowed_tokens
    return chunk.proposed_allowed[row - 1]


def _decode_rows(chunk: ScheduledChunk) -> bool:
    """A chunk computed as decode rows: one token, or a speculating request's tokens."""
    return len(chunk.token_ids) == 1 or bool(chunk.proposed)
