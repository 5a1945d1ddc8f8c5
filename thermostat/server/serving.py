"""Submitting a request to the engine and following it: `Serving.submit` -> `Job`.

A Job is one response: `len(prompts) * n` engine requests (choice `index` is prompt
`index // n`, sample `index % n`). It accumulates each choice from the engine's deltas, measures
TTFT and inter-token latency, computes the quality report of each finished choice, feeds the
metrics and writes the request's log line when it ends, however it ends (finished, client gone,
engine error). What a choice reports as applied is what the engine accepted it with
(`OutputStream.queued`): the resolution is never restated here.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from thermostat.api.disconnect import until_disconnected
from thermostat.api.errors import APIError, classify
from thermostat.api.metrics import Metrics
from thermostat.api.protocol import PromptTokensDetails, Usage
from thermostat.api.responses import response_quality
from thermostat.engine.outputs import Completion, RequestDelta
from thermostat.engine.steps import Handoff, TokenLogprobs
from thermostat.quality import quality_report
from thermostat.sampling import (
    Resolution,
    SamplingDefaults,
    SamplingParams,
    resolve,
)
from thermostat.sampling.fanout import Plan, plan
from thermostat.server.async_engine import AsyncEngine
from thermostat.server.engine_io import GroupInput, OutputStream
from thermostat.server.prompts import Prompt

request_log = logging.getLogger("thermostat.requests")


@dataclass
class Job:
    id: str
    endpoint: str
    model: str
    prompts: list[Prompt]
    n: int
    stream: OutputStream
    metrics: Metrics
    arrival: float  # time.monotonic()
    created: int = field(default_factory=lambda: int(time.time()))
    choices: dict[int, Completion] = field(default_factory=dict)  # by index, as deltas arrive
    quality: dict[int, dict[str, Any]] = field(default_factory=dict)  # of finished choices
    prompt_logprobs: dict[int, list[TokenLogprobs | None]] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)  # by choice, from its deltas
    handoffs: dict[int, Handoff] = field(default_factory=dict)  # prefill role, by choice
    sampling_extra: dict[str, Any] = field(default_factory=dict)  # added to every `sampling`
    client: str | None = None  # the User-Agent (the console's recent requests)
    first_token_s: float | None = None
    num_generated: int = 0  # tokens generated so far, over all choices (aborted ones included)
    _last_token: dict[int, float] = field(default_factory=dict)
    _logged: bool = False

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of(self, index: int) -> Prompt:
        return self.prompts[index // self.n]

    def resolution(self, index: int = 0) -> Resolution:
        """What choice `index` runs with (each prompt's max_tokens fitted to its length, sample
        j of a seeded request on seed + j); choice 0's is the response's `sampling`."""
        return self.stream.queued[index].resolution

    def sampling(self, index: int = 0) -> dict[str, Any]:
        """The `sampling` object of choice `index` (choice 0's is the response's), with what
        speculation did for it when it is on."""
        choice = self.choices.get(index)
        spec = None if choice is None else choice.speculative
        extra = {} if spec is None else {"speculative": spec}
        return self.resolution(index).to_dict() | self.sampling_extra | extra

    def usage(self) -> Usage:
        """Tokens so far: each prompt once (and its prefix-cache hits, as its first sample
        saw them), every choice's generated tokens."""
        prompt = sum(len(p.token_ids) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices.values())
        cached = sum(self.cached_tokens.get(i * self.n, 0) for i in range(len(self.prompts)))
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    def header(self) -> dict[str, Any]:
        """Fields every response object and stream chunk of this job starts with."""
        return {"id": self.id, "created": self.created, "model": self.model}

    def choice_end(self, index: int) -> dict[str, Any]:
        """Fields of a finished choice: why it ended and its quality report."""
        choice = self.choices[index]
        return {
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
            "quality": self.quality[index],
        }

    def choice_sampling(self, index: int) -> dict[str, Any] | None:
        """A whole response's choice carries its own `sampling` where it differs from the
        response's (another prompt's fitted max_tokens, a seeded sample's seed)."""
        own = self.sampling(index)
        return None if own == self.sampling() else own

    def last_chunk_fields(self, index: int) -> dict[str, Any]:
        """What the chunk that finishes choice `index` carries besides the choice."""
        return {"sampling": self.sampling(index), "quality": self.quality[index]}

    def final_fields(self) -> dict[str, Any]:
        """The header plus what a whole (non-streamed) response adds: usage, sampling, quality."""
        return self.header() | {
            "usage": self.usage(),
            "sampling": self.sampling(),
            "quality": response_quality([self.quality[i] for i in sorted(self.quality)]),
        }

    async def events(self) -> AsyncIterator[tuple[int, RequestDelta]]:
        """Deltas as they come, each already added to its choice; on any exit the unfinished
        requests are aborted."""
        status = "aborted"
        try:
            async for index, delta in self.stream:
                self._observe(index, delta)
                yield index, delta
            status = "ok"
        except APIError:
            status = "error"
            raise
        except Exception as exc:
            status = "error"
            raise classify(exc) from exc
        finally:
            self.stream.abort()
            self._log(status)

    async def collect(self, request: Request) -> None:
        """Run to completion (non-streaming); raises ClientGone if the client leaves first."""

        async def run() -> None:
            async for _ in self.events():
                pass

        await until_disconnected(run(), request)

    def _observe(self, index: int, delta: RequestDelta) -> None:
        now = time.monotonic()
        choice = self.choices.setdefault(index, Completion())
        choice.add(delta)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[index] = delta.prompt_logprobs
        self.cached_tokens[index] = delta.num_cached_tokens
        if delta.handoff is not None:
            self.handoffs[index] = delta.handoff
        if delta.new_token_ids:
            self.num_generated += len(delta.new_token_ids)
            self.metrics.on_tokens(len(delta.new_token_ids))
            last = self._last_token.get(index)
            if last is None:
                self.metrics.on_first_token(now - self.arrival)
                if self.first_token_s is None:
                    self.first_token_s = now - self.arrival
            else:
                self.metrics.itl.observe(now - last)
            self._last_token[index] = now
        if delta.finished:
            if delta.speculative is not None:
                self.metrics.on_speculation(delta.speculative)
            report = quality_report(choice.text)
            self.quality[index] = report
            self.metrics.on_quality(report)
            if len(self.quality) == self.num_choices:
                self.metrics.e2e.observe(now - self.arrival)

    def _log(self, status: str) -> None:
        if self._logged:
            return
        self._logged = True
        sampling = self.sampling() if self.stream.queued else {}
        usage = self.usage()
        line = {
            "id": self.id,
            "endpoint": self.endpoint,
            "model": self.model,
            "status": status,
            "n": self.n,
            "effective": sampling.get("effective"),
            "source": sampling.get("source"),
            "adjusted": sampling.get("adjusted"),
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": self.num_generated,
            "finish_reason": [self.choices[i].finish_reason for i in sorted(self.quality)],
            "degenerate": [self.quality[i]["flags"] for i in sorted(self.quality)],
            "ttft_s": None if self.first_token_s is None else round(self.first_token_s, 4),
            "latency_s": round(time.monotonic() - self.arrival, 4),
        }
        request_log.info(json.dumps(line))
        done = sorted(self.quality)
        self.metrics.traffic.record(
            request_id=self.id,
            endpoint=self.endpoint,
            client=self.client,
            status=status,
            sampling=sampling,
            quality=response_quality([self.quality[i] for i in done]) if done else {},
            finish_reasons=[self.choices[i].finish_reason for i in done],
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=self.num_generated,
            ttft_s=line["ttft_s"],
            latency_s=line["latency_s"],
            text=[self.choices[i].text for i in done],
        )


@dataclass(eq=False)
class Serving:
    """Checks and submits requests for one model: model name, queue room, resolution."""

    model: str
    engine: AsyncEngine
    defaults: SamplingDefaults
    metrics: Metrics
    max_queue: int | None
    retry_after_s: int
    context_len: int

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model:
            raise APIError(
                404,
                f"model {name!r} is not served here; this server serves {self.model!r}",
                param="model",
                code="model_not_found",
            )

    def explain(self, model: str | None, params: SamplingParams) -> Resolution:
        self.check_model(model)
        return resolve(params, self.defaults)

    def plan(
        self,
        model: str | None,
        prompts: list[Prompt],
        params: SamplingParams,
        cap_max_tokens: bool = False,
    ) -> Plan:
        """The request's one plan: resolved, each choice fitted to its prompt (`cap_max_tokens`:
        a sent max_tokens cut to the room, as the agents' APIs serve it). Raises APIError (4xx)
        for what cannot be served."""
        self.check_model(model)
        try:
            resolution = resolve(params, self.defaults)
            ids = [p.token_ids for p in prompts]
            return plan(resolution, ids, self.context_len, params.n or 1, cap_max_tokens)
        except Exception as exc:
            raise classify(exc) from exc

    async def submit(
        self,
        endpoint: str,
        prompts: list[Prompt],
        planned: Plan,
        *,
        handoff: bool = False,
        handoffs: list[Handoff] | None = None,
        sampling_extra: dict[str, Any] | None = None,
        client: str | None = None,
    ) -> Job:
        """Queue a planned request; raises APIError (4xx for bad input, 503 when the queue is
        full) before anything is sent to the client. `handoff` and `handoffs`: the prefill and
        decode roles (LLMEngine.add_group); `sampling_extra` joins every `sampling` object."""
        arrival = time.monotonic()
        if self.max_queue is not None and self.engine.num_waiting >= self.max_queue:
            raise APIError(
                503,
                f"the server's queue is full ({self.engine.num_waiting} requests waiting); retry",
                type="server_error",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        prefix = "cmpl" if endpoint == "completions" else "chatcmpl"
        job_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            stream = await self.engine.add(GroupInput(job_id, planned, handoff, handoffs))
        except Exception as exc:  # refusals become 4xx; an engine that is down, a 500
            raise classify(exc) from exc
        job = Job(job_id, endpoint, self.model, prompts, planned.n, stream, self.metrics, arrival)
        job.sampling_extra = sampling_extra or {}
        job.client = client
        self.metrics.on_admitted(job.resolution(), sum(len(p.token_ids) for p in prompts))
        return job
