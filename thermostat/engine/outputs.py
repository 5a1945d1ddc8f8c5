"""What the engine reports about a request after each step."""

from __future__ import annotations

from dataclasses import dataclass

from thermostat.engine.sampler import TokenLogprobs
from thermostat.sampling.resolve import Resolution


@dataclass
class RequestOutput:
    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated tokens so far (a stop token included)
    text: str  # released text so far (stop strings excluded)
    delta: str  # text released by this step
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    stop_reason: str | int | None  # the stop string or stop token id that ended it
    sampling: Resolution
    logprobs: list[TokenLogprobs] | None = None  # one per generated token, when asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # first entry None
    num_cached_tokens: int = 0
