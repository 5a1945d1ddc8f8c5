"""A request's state: counters, with everything else derived.

There is no prefill or decode phase: a request is behind by `num_tokens - num_computed_tokens`
tokens, and each step lets it catch up some of them. That covers chunked prefill, prefix-cache
hits (computed tokens start above zero), decode (behind by one) and recompute after preemption
(computed tokens reset to zero).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from thermostat.engine.block_manager import hash_block_tokens
from thermostat.engine.constraint import Constraint
from thermostat.engine.output_text import OutputText
from thermostat.engine.steps import Handoff
from thermostat.sampling.params import EffectiveParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    req_id: str
    prompt_token_ids: list[int]
    params: EffectiveParams
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # of every full block, chained
    status: RequestStatus = RequestStatus.WAITING
    # once finished: "stop" | "length" | "abort" | "handoff" | "error" (a constraint dead end)
    finish_reason: str | None = None
    # the stop token id, stop string or "loop" of a "stop"; "constraint_dead_end" of an "error"
    stop_reason: str | int | None = None
    text: OutputText | None = None  # None: no text-level stop conditions (token ids only)
    constraint: Constraint | None = None  # structured output: the grammar's state
    # Disaggregation. A handoff request ends ("handoff") once its first token is sampled;
    # `handoff_slots` are then the cache slots of its prompt's rows (per pool: Scheduler.slots).
    # A request can also start from another engine's handoff (`from_handoff`: the prompt's rows
    # and the first token; dropped once loaded, so after a preemption the prompt is recomputed).
    handoff: bool = False
    handoff_slots: list[list[int]] | None = None
    from_handoff: Handoff | None = None
    # speculation (engine/speculative.py): tokens proposed and confirmed so far
    num_proposed: int = 0
    num_accepted: int = 0
    num_verifications: int = 0  # steps that checked proposals
    drafts: list[int] = field(default_factory=list)  # the next-n layer's, after the last step

    @property
    def max_tokens(self) -> int:
        """The fitted max_tokens (the edge's plan always sets it)."""
        if self.params.max_tokens is None:
            raise ValueError(f"request {self.req_id}: max_tokens was not fitted to its prompt")
        return self.params.max_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_behind(self) -> int:
        """Tokens whose K/V are not in the cache yet."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        p = self.num_prompt_tokens
        if end <= p:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids[start:] if start < p else []) + self.output_token_ids[
            max(start - p, 0) : end - p
        ]

    def update_block_hashes(self, block_size: int) -> None:
        """Extend `block_hashes` to cover every full block of the tokens so far."""
        while (len(self.block_hashes) + 1) * block_size <= self.num_tokens:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            tokens = self.token_ids(i * block_size, (i + 1) * block_size)
            self.block_hashes.append(hash_block_tokens(parent, tokens))

    def banned_token_ids(self) -> tuple[int, ...]:
        """Stop tokens may not be sampled before min_tokens outputs."""
        if self.num_output_tokens < self.params.min_tokens:
            return tuple(sorted(self.stop_ids))
        return ()
