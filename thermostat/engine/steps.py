"""The data at the engine's seams: plain dataclasses, so the same objects can cross a process
boundary.

| type            | from -> to                                                                 |
|-----------------|----------------------------------------------------------------------------|
| SchedulerOutput | Scheduler.schedule -> ModelRunner.execute (chunks, new requests, handoffs) |
| RunnerOutput    | ModelRunner.execute -> Scheduler.update                                    |
| SamplerOutput   | sampler.sample_batch -> ModelRunner                                        |
| Handoff         | one engine's handoff delta -> another engine's add_group (PD)              |
| TokenLogprobs   | one scored token, in all of the above and in the deltas                    |
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from thermostat.engine.constraint import Bitmask
from thermostat.models.kv_spec import KVRows
from thermostat.sampling.params import EffectiveParams


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float  # natural log, raw model distribution (after banning)
    rank: int  # 1-based: 1 + number of tokens with a strictly larger logprob
    top: list[tuple[int, float]]  # the k most likely (token_id, logprob), best first


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


@dataclass(frozen=True)
class Handoff:
    """A request's prompt computed and its first token sampled by one engine, for another to
    continue from (prefill/decode disaggregation): what a handoff request's last delta carries
    and what `LLMEngine.add_group(handoffs=...)` takes."""

    rows: KVRows  # every prompt token's cache rows, as stored
    first_token: int
    first_logprobs: TokenLogprobs | None  # when logprobs were asked for
    generator_state: torch.Tensor | None  # the seeded generator after the first token
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # when asked for; [0] is None


@dataclass
class NewRequestData:
    """What the runner keeps about a request from its first step until it finishes."""

    req_id: str
    prompt_token_ids: list[int]
    params: EffectiveParams


@dataclass
class ScheduledChunk:
    """Compute K/V for tokens [start, start + len(token_ids)) of one request."""

    req_id: str
    token_ids: list[int]
    start: int
    block_table: list[int]  # the main pool's
    sample: bool  # the request catches up this step: sample its next token
    banned_token_ids: tuple[int, ...] = ()
    allowed_tokens: Bitmask | None = None  # a constrained request's next token (engine/constraint)
    window_tables: list[list[int]] = field(default_factory=list)  # pools 1.. (engine/kv_blocks)
    # speculation: token_ids is [last token] + proposed; each is computed as a decode row
    proposed: list[int] = field(default_factory=list)
    # a constrained request's bitmask after each proposal (the rows after `allowed_tokens`')
    proposed_allowed: list[Bitmask] = field(default_factory=list)


@dataclass
class ScheduledHandoff:
    """Another engine's prefill of a request admitted this step: the runner writes its rows into
    the request's first slots and takes its first token as this step's sample."""

    req_id: str
    slots: list[list[int]]  # per pool: the slots of the rows it carries (Scheduler.slots)
    handoff: Handoff


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    handoffs: list[ScheduledHandoff] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # the runner may drop their state

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # a speculating request's tokens after `sampled`: the proposals the model confirmed, then its
    # own next token (engine/speculative.py); and their logprobs when asked for
    speculated: dict[str, list[int]] = field(default_factory=dict)
    speculated_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # `--speculative mtp`: what the model's next-n layer proposes after this step's tokens
    drafts: dict[str, list[int]] = field(default_factory=dict)
    # prompt position -> logprobs of the prompt token at that position (position >= 1)
    prompt_logprobs: dict[str, dict[int, TokenLogprobs]] = field(default_factory=dict)
