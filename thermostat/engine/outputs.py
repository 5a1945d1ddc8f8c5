"""What the engine emits after each step (`RequestDelta`: only what is new) and what a front end
builds from the deltas of one request (`Completion`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from thermostat.engine.steps import Handoff, TokenLogprobs
from thermostat.sampling.resolve import Resolution


@dataclass(frozen=True)
class QueuedRequest:
    """One request of a group the engine accepted, and the sampling it runs with."""

    req_id: str
    index: int  # in the group: prompt index * n + sample index
    prompt_token_ids: list[int]
    resolution: Resolution


@dataclass(frozen=True)
class RequestDelta:
    """What one step did for one request. Emitted when it generated tokens or finished; the
    engine keeps no reference to it."""

    req_id: str
    new_token_ids: list[int]  # a stop token that ended the request included
    new_text: str  # text released by this step (a stop string never is)
    new_logprobs: list[TokenLogprobs] | None  # one per new token; None unless asked for
    finish_reason: str | None = None  # "stop" | "length" | "handoff" on the request's last delta
    stop_reason: str | int | None = None  # the stop string, stop token id or "loop" that ended it
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # first delta only; [0] is None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    handoff: Handoff | None = None  # a handoff request's last delta: what it hands over
    # speculation so far: {"method", "k", "proposed", "accepted", "steps"} (None: off)
    speculative: dict[str, int | str] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Completion:
    """One generated sequence, accumulated from its request's deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per generated token, when asked
    speculative: dict[str, int | str] | None = None  # the last delta's (None: off)

    def add(self, delta: RequestDelta) -> None:
        self.text += delta.new_text
        self.token_ids.extend(delta.new_token_ids)
        if delta.new_logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.new_logprobs)
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason
        self.speculative = delta.speculative

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
